"""gpt-oss-tiny on the exact CPU reference server: a tool conversation with drops and repositions,
cold and warm, gives the oracle's greedy tokens and log-probabilities."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from akv.system.context.compiler import append_generated
from akv.system.context.request import compile_request
from akv.system.reference.gpt_oss import GptOssReferenceModel
from akv.system.reference.oracle import run_program
from akv.system.reference_server import Engine, ReferenceServer
from tests.gpt_oss.conversation import MESSAGES, TOOLS, template_inputs
from http_client import post_ok

MODEL = "gpt-oss-tiny"


@pytest.fixture(scope="module")
def server_url(gpt_oss_dir: Path) -> Iterator[tuple[str, Engine]]:
    engine = Engine(gpt_oss_dir, name=MODEL, kv_slots=4096)
    server = ReferenceServer(engine)
    with server.running():
        yield server.url, engine


def _assert_matches_oracle(model: GptOssReferenceModel, tokenizer: Any, reply: dict[str, Any], n_messages: int,
                           rules: dict[str, Any]) -> np.ndarray:
    """Served tokens and log-probs equal the oracle's; returns the prompt's token owners."""
    messages, tools = template_inputs(n_messages)
    compiled = compile_request(tokenizer, messages, tools=tools, **rules)
    program = compiled.program
    entries = reply["choices"][0]["logprobs"]["content"]
    assert reply["usage"]["prompt_tokens"] == program.n_prompt
    generated = np.asarray([e["token_id"] for e in entries], dtype=np.int64)
    log_probs = run_program(model, append_generated(program, generated)).log_probs()
    for j, entry in enumerate(entries):
        row = log_probs[program.n_prompt - 1 + j]
        assert entry["token_id"] == int(torch.argmax(row)), j
        assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=3e-4)
    return compiled.provenance.owners


def test_tool_conversation_with_drops_is_served_exactly(server_url: tuple[str, Engine], gpt_oss_dir: Path,
                                                        harmony_tokenizer: Any) -> None:
    """Turn 2 reuses all of turn 1's prompt (two tokens re-rotated by its reposition); turn 3 has a
    final answer, so the template drops message 2's analysis and reuse stops two tokens into message 2."""
    url, _ = server_url
    model = GptOssReferenceModel.from_pretrained(gpt_oss_dir)
    turns = [(4, None, None), (7, {"6": [3]}, [6]), (len(MESSAGES), {"6": [3], "10": [5, 6]}, [6])]
    usage, owners = [], []
    for n_messages, drop_message, reposition in turns:
        body = {"model": MODEL, "messages": MESSAGES[:n_messages], "tools": TOOLS, "max_tokens": 4,
                "logprobs": True, "temperature": 0, "drop_message": drop_message, "reposition": reposition}
        reply = post_ok(url, body, timeout=300)
        owners.append(_assert_matches_oracle(model, harmony_tokenizer, reply, n_messages,
                                             {"drop_message": drop_message, "reposition": reposition}))
        usage.append(reply["usage"])
    first, second, third = (u["prompt_tokens_details"] for u in usage)
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] + second["repos_tokens"] == usage[0]["prompt_tokens"] and second["repos_tokens"] > 0
    assert third["cached_tokens"] == int((owners[2] < 2).sum()) + 2  # and message 2's "<|start|>assistant"
