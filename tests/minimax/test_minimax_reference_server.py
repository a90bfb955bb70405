"""The reference server serves MiniMax-M2 (its loader picks the MiniMax-M2 reference model): a chat
turn with a drop and a reposition gets the oracle's first-token log-probabilities (FP32)."""

from __future__ import annotations

from pathlib import Path

import torch

from akv.system.reference.minimax_m2 import MiniMaxM2Model
from akv.system.reference.oracle import run_program
from akv.system.reference_server.engine import Engine
from akv.system.reference_server.protocol import parse_chat_request

MESSAGES = [{"role": "system", "content": "You follow record chains."},
            {"role": "user", "content": "Read record A."},
            {"role": "assistant", "content": "Reading A."},
            {"role": "user", "content": "Record A: shipment 7 left; see record B."},
            {"role": "assistant", "content": "Reading B."},
            {"role": "user", "content": "Record B: it arrived."}]


def test_a_context_turn_gets_the_oracles_first_token(minimax_dir: Path, minimax: MiniMaxM2Model) -> None:
    engine = Engine(minimax_dir, name="default", kv_slots=2048)
    assert isinstance(engine.model, MiniMaxM2Model)
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 1, "temperature": 0.0,
            "drop_message": {"5": [3]}, "reposition": [5]}
    request = parse_chat_request(body, "default")
    prepared = engine.prepare(request)
    step = engine.generate(prepared, request, None).steps[0]
    expected = run_program(minimax, prepared.program).log_probs()[prepared.program.n_tokens - 1]
    assert step.chosen.token_id == int(expected.argmax())
    torch.testing.assert_close(torch.tensor(step.chosen.logprob), expected.max(), atol=2e-5, rtol=0)
