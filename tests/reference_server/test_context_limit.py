"""The context-length limit counts positions, not prompt tokens: after a reposition compacts the
context, the room for new tokens is ``max_context - next_position``, more than a plain prompt of
the same length leaves; a prompt whose next position is already at the limit is a 400 naming
``messages`` that clients recognise as a context-length error."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from akv.agent import send_chat_request
from akv.agent.errors import ContextLengthError
from akv.agent.templating import template_messages
from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server import Engine, ReferenceServer
from akv.system.reference_server.model_dir import load_model_dir
import http_client

MODEL = "tiny-test"
MESSAGES = [
    {"role": "system", "content": "You keep notes."},
    {"role": "user", "content": " ".join(f"note {i}: the crate count is {i * 13 % 71}." for i in range(10))},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "What now?"},
]
COMPACTED = {"drop_message": {"2": [1]}, "reposition": [2]}  # drop the long note, close the gap


def owners(model_dir: Path) -> np.ndarray:
    """Which message owns each prompt token, as the template renders the request."""
    files = load_model_dir(model_dir)
    owned = ChatTemplate(files.chat_template).render_owned(template_messages(MESSAGES), add_generation_prompt=True)
    return np.asarray(token_provenance(owned, files.tokenizer).owners)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[str, int, int]]:
    """A model whose maximum context is exactly the plain prompt's length; yields (url, prompt, dropped)."""
    who = owners(tiny_model_dir)
    n_prompt, dropped = len(who), int((who == 1).sum())
    model_dir = make_tiny_model(tmp_path_factory.mktemp("limited") / "model", seed=3,
                                max_position_embeddings=n_prompt)
    engine = Engine(model_dir, name=MODEL, kv_slots=4096)
    engine.files = dataclasses.replace(engine.files, eos_token_ids=frozenset())  # always run to the limit
    server = ReferenceServer(engine)
    with server.running():
        yield server.url, n_prompt, dropped


def post(url: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    return http_client.post(url, body)


def test_a_prompt_at_the_limit_is_refused_naming_messages(limited: tuple[str, int, int]) -> None:
    url, n_prompt, _ = limited
    status, reply = post(url, max_tokens=1)
    assert status == 400 and reply["error"]["param"] == "messages"
    assert f"maximum context length of {n_prompt} tokens" in reply["error"]["message"]
    with pytest.raises(ContextLengthError):
        send_chat_request(url, {"model": MODEL, "messages": MESSAGES, "stream": True}, timeout=120)


def test_a_compacted_prompt_has_room_for_the_positions_it_freed(limited: tuple[str, int, int]) -> None:
    url, n_prompt, dropped = limited
    assert dropped > 1
    # The same prompt, its next position moved back by the dropped note's length: that many tokens fit.
    status, reply = post(url, max_tokens=10 * n_prompt, **COMPACTED)
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == n_prompt
    assert reply["usage"]["completion_tokens"] == dropped
    assert reply["choices"][0]["finish_reason"] == "length"
    status, reply = post(url, max_tokens=dropped - 1, **COMPACTED)
    assert status == 200 and reply["usage"]["completion_tokens"] == dropped - 1
