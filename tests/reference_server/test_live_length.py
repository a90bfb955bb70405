"""A tool conversation whose text is 4x the model's context length, served by the reference server
because each turn drops the previous one and repositions: every turn's tokens and log-probs equal
the oracle's. The same conversation without drops is refused with a 400 naming ``messages`` and its
live length (its whole text, counted by hand from the render). Nothing stays held afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from akv.agent.templating import template_messages
from akv.system.context.compiler import append_generated, compile_program
from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.context.rules import parse_rules
from akv.system.models.tiny import make_tiny_model
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_program
from akv.system.reference_server import Engine, ReferenceServer
from akv.system.reference_server.model_dir import load_model_dir

from .test_exactness import TOOLS, TOOLS_AS_RENDERED, _call, _record
import http_client

pytestmark = pytest.mark.slow
MODEL = "tiny-live"
TURNS = 9
CONTEXT = 640
MAX_TOKENS = 3


def conversation() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You follow shipment records."},
                                      {"role": "user", "content": "Where is shipment 7? Start at record 0."}]
    for turn in range(TURNS):
        call = len(messages)
        messages.append({"role": "assistant", "content": None, "tool_calls": [_call(call, str(turn))]})
        messages.append({"role": "tool", "tool_call_id": f"c{call}", "content": _record(str(turn), str(turn + 1))})
    return messages


MESSAGES = conversation()


def fields(n_messages: int) -> dict[str, Any]:
    """Each assistant call after the first drops the previous turn and repositions."""
    anchors = range(4, n_messages, 2)
    return {"drop_message": {str(a): [a - 2, a - 1] for a in anchors}, "reposition": list(anchors)}


def program(model_dir: Path, n_messages: int, drop_message: Any, reposition: Any) -> Any:
    files = load_model_dir(model_dir)
    owned = ChatTemplate(files.chat_template).render_owned(template_messages(MESSAGES[:n_messages]),
                                                          tools=TOOLS_AS_RENDERED, add_generation_prompt=True)
    prov = token_provenance(owned, files.tokenizer)
    return compile_program(prov.token_ids, prov.owners, parse_rules(drop_message, reposition, n_messages), n_messages)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine, Path]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("live") / "model", seed=3, max_position_embeddings=CONTEXT)
    engine = Engine(model_dir, name=MODEL, kv_slots=8192)
    server = ReferenceServer(engine)
    with server.running():
        yield server.url, engine, model_dir


def post(url: str, n_messages: int, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "messages": MESSAGES[:n_messages], "tools": TOOLS, "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 1, **extra}
    return http_client.post(url, body, timeout=300)


def test_the_text_is_4x_the_context_and_the_live_length_fits(served: tuple) -> None:
    n = len(MESSAGES)
    last = program(served[2], n, **fields(n))
    assert last.n_prompt >= 4 * CONTEXT
    assert int(last.birth_position.max()) < CONTEXT and last.next_position + MAX_TOKENS <= CONTEXT


def test_every_turn_equals_the_oracle(served: tuple) -> None:
    url, engine, model_dir = served
    model = ReferenceModel.from_pretrained(model_dir)
    for n in (6, 12, len(MESSAGES)):
        status, reply = post(url, n, **fields(n))
        assert status == 200, reply
        prompt = program(model_dir, n, **fields(n))
        entries = reply["choices"][0]["logprobs"]["content"]
        served_ids = np.asarray([e["token_id"] for e in entries], dtype=np.int64)
        rows = run_program(model, append_generated(prompt, served_ids)).log_probs()[prompt.n_prompt - 1:]
        assert served_ids.tolist() == rows.argmax(-1).tolist()[: served_ids.size], f"turn at {n} messages"
        oracle = rows[torch.arange(served_ids.size), torch.from_numpy(served_ids)]
        assert [e["logprob"] for e in entries] == pytest.approx(oracle.tolist(), abs=1e-4)
    assert engine.cache.active == 0 and engine.pool.n_protected == 0


def test_without_drops_the_400_names_messages_and_the_live_length(served: tuple) -> None:
    url, engine, model_dir = served
    n = len(MESSAGES)
    text = program(model_dir, n, None, None).n_prompt
    status, reply = post(url, n, reposition=[n - 1])
    assert status == 400 and reply["error"]["param"] == "messages", reply
    message = reply["error"]["message"]
    assert f"the live length is {text} tokens" in message
    assert f"maximum context length of {CONTEXT} tokens" in message
    assert f"at least {text + 1 - CONTEXT} more tokens" in message
    assert engine.cache.active == 0 and engine.pool.n_protected == 0
