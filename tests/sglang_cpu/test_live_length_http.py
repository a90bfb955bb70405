"""The live-length rule through the whole patched server on the CPU (HTTP layer, tokenizer manager,
scheduler) with a 256-token model: a conversation whose text is 4x that, each turn dropping the
previous one, gets the reference server's reply and usage; without drops, and with a 2 MB tool result
that alone passes the context before its drop, it is a 400 on ``messages`` naming the live length."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server.model_dir import load_model_dir

from .test_http import post, sglang_url  # noqa: F401 (fixture, on this module's model)

pytestmark = pytest.mark.slow
CONTEXT = 256
TURNS = 9


@pytest.fixture(scope="module", autouse=True)
def text_columns() -> Iterator[None]:
    """Rows for texts up to 8x the context (the default is 4x, which a 4x text would just pass)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AKV_MAX_TEXT_TOKENS", str(8 * CONTEXT))
        yield


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The served model of this module: the session's tiny Qwen3 with a 256-token context."""
    yield make_tiny_model(tmp_path_factory.mktemp("live-http") / "model", seed=3, max_position_embeddings=CONTEXT)


def conversation() -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You follow records."}, {"role": "user", "content": "Start at 0."}]
    for k in range(TURNS):
        messages.append({"role": "assistant", "content": f"Reading {k}."})
        record = " ".join(f"crate {k * 7 + j}" for j in range(12))
        messages.append({"role": "user", "content": f"Record {k}: {record}"})
    return messages


MESSAGES = conversation()
ANCHORS = list(range(4, len(MESSAGES), 2))
DROPS = {"drop_message": {str(a): [a - 2, a - 1] for a in ANCHORS}, "reposition": ANCHORS}


def body(messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    return {"model": "default", "messages": messages, "max_tokens": 3, "temperature": 0.0, **fields}


def text_tokens(model: Path, messages: list[dict[str, str]]) -> int:
    files = load_model_dir(model)
    owned = ChatTemplate(files.chat_template).render_owned(messages, add_generation_prompt=True)
    return len(token_provenance(owned, files.tokenizer).token_ids)


def test_a_text_4x_the_context_is_served_like_the_reference(sglang_url: str, reference_url: str,  # noqa: F811
                                                            tiny_qwen3: Path) -> None:
    assert text_tokens(tiny_qwen3, MESSAGES) >= 4 * CONTEXT
    (got_status, got), (want_status, want) = post(sglang_url, body(MESSAGES, **DROPS)), post(reference_url,
                                                                                           body(MESSAGES, **DROPS))
    assert got_status == want_status == 200, (got, want)
    assert got["content"] == want["content"]
    for key in ("prompt_tokens", "completion_tokens", "prompt_tokens_details"):
        assert got["usage"][key] == want["usage"][key], key


def test_without_drops_it_is_a_400_naming_the_live_length(sglang_url: str, tiny_qwen3: Path) -> None:  # noqa: F811
    status, error = post(sglang_url, body(MESSAGES, reposition=[len(MESSAGES) - 1]))
    text = text_tokens(tiny_qwen3, MESSAGES)
    assert status == 400 and error["param"] == "messages", error
    assert f"the live length is {text} tokens" in error["message"]
    assert f"maximum context length of {CONTEXT} tokens" in error["message"]
    assert f"at least {text + 3 - CONTEXT} more tokens" in error["message"]


def test_a_2mb_tool_result_dropped_at_the_next_anchor_is_a_400_naming_the_live_length(
        sglang_url: str) -> None:  # noqa: F811
    big = [*MESSAGES[:3], {"role": "user", "content": "crate " * (2_000_000 // 6)},
           {"role": "assistant", "content": "Done."}]
    status, error = post(sglang_url, body(big, drop_message={"4": [3]}, reposition=[4]))
    assert status == 400 and error["param"] == "messages", error
    assert "the live length is" in error["message"] and "reaches position" in error["message"]
    assert "crate crate" not in error["message"], "the request body is echoed back"


def test_the_server_still_serves_afterwards(sglang_url: str) -> None:  # noqa: F811
    status, reply = post(sglang_url, body(MESSAGES[:6], **{"drop_message": {"4": [2, 3]}, "reposition": [4]}))
    assert status == 200, reply
