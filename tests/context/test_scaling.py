"""Provenance and compile of a 1M-token text with over 90% of it dropped stay linear: the CPU time
per token at 1M tokens is about that at 100k (a quadratic step would make it ten times as much),
checked as a ratio of the same work at two sizes, never against a wall-clock threshold."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from akv.system.context.compiler import compile_program
from akv.system.context.limits import live_length
from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.context.rules import parse_rules
from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server.model_dir import load_model_dir

pytestmark = pytest.mark.slow
LINEAR_BOUND = 2.5  # per-token cost at 10x the text: about 1 when linear, about 10 when quadratic


def conversation(turns: int) -> list[dict[str, str]]:
    """A task, then per turn a short call and a result (about 1,000 tokens of the tiny tokenizer)."""
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": f"call {i}"})
        messages.append({"role": "user", "content": " ".join(f"r{i} w{k}" for k in range(120))})
    return messages


def provenance_and_compile(template: ChatTemplate, tokenizer: object, turns: int) -> tuple[int, int, float]:
    """Text length, live length and CPU seconds of render, provenance and compile, each call
    dropping the previous result and repositioning."""
    messages = conversation(turns)
    n = len(messages)
    anchors = range(4, n, 2)
    rules = parse_rules({str(a): [a - 1] for a in anchors}, list(anchors), n)
    began = time.process_time()
    prov = token_provenance(template.render_owned(messages, add_generation_prompt=True), tokenizer)
    program = compile_program(prov.token_ids, prov.owners, rules, n)
    return program.n_tokens, live_length(program), time.process_time() - began


def test_a_1m_token_text_90_percent_dropped_compiles_in_linear_time(tmp_path: Path) -> None:
    files = load_model_dir(make_tiny_model(tmp_path / "model", seed=3))
    template = ChatTemplate(files.chat_template)
    small = min(provenance_and_compile(template, files.tokenizer, 100) for _ in range(3))
    large = min(provenance_and_compile(template, files.tokenizer, 1030) for _ in range(1))
    assert large[0] >= 1_000_000 and large[1] < 0.1 * large[0] and large[0] >= 9 * small[0]
    ratio = (large[2] / large[0]) / (small[2] / small[0])
    print(f"per-token cost at {large[0]} tokens: {ratio:.2f}x that at {small[0]}")
    assert ratio < LINEAR_BOUND, (small, large)
