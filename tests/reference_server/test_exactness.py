"""Served tokens and log-probabilities equal the semantic oracle's, through drops, repositions and
cache reuse, and the usage counters match a hand-worked count over message ownership."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from akv.agent import send_chat_request
from akv.agent.templating import template_messages
from akv.system.context.compiler import append_generated, compile_program
from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.context.rules import parse_rules
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_program
from akv.system.reference_server.model_dir import load_model_dir
from http_client import post_ok

MODEL = "tiny-test"
RECORD_ID = {"type": "object", "properties": {"record_id": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read_record", "description": "read a record",
                                           "parameters": RECORD_ID}}]
# What SGLang's serving_chat passes to the template for TOOLS: each Tool's pydantic model_dump().
TOOLS_AS_RENDERED = [{"type": "function", "function": {"description": "read a record", "name": "read_record",
                                                       "parameters": RECORD_ID, "strict": False},
                      "defer_loading": None}]


def _call(i: int, record: str) -> dict[str, Any]:
    return {"id": f"c{i}", "type": "function",
            "function": {"name": "read_record", "arguments": json.dumps({"record_id": record})}}


def _record(name: str, following: str) -> str:
    lines = [f"line {k} of record {name}: {k * 7} crates of tea, seal {k * 131 % 997}" for k in range(6)]
    return "\n".join(lines + [f"next record: {following}"])


CONVERSATION = [
    {"role": "system", "content": "You follow shipment records."},
    {"role": "user", "content": "Where is shipment 7? Start at A."},
    {"role": "assistant", "content": None, "tool_calls": [_call(2, "A")]},
    {"role": "tool", "tool_call_id": "c2", "content": _record("A", "B")},
    {"role": "assistant", "content": None, "tool_calls": [_call(4, "B")]},
    {"role": "tool", "tool_call_id": "c4", "content": _record("B", "C")},
    {"role": "assistant", "content": "Reading C next.", "tool_calls": [_call(6, "C")]},
    {"role": "tool", "tool_call_id": "c6", "content": _record("C", "none; final stop is Dock 9")},
]


@pytest.fixture(scope="module")
def oracle_model(served: Any) -> ReferenceModel:
    return ReferenceModel.from_pretrained(served.model_dir)


def body(n_messages: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CONVERSATION[:n_messages], "tools": TOOLS, "max_tokens": 8,
            "logprobs": True, "top_logprobs": 5, **fields}


def provenance(served: Any, n_messages: int) -> Any:
    files = load_model_dir(served.model_dir)
    messages = template_messages(CONVERSATION[:n_messages])  # SGLang's normalisation
    owned = ChatTemplate(files.chat_template).render_owned(messages, tools=TOOLS_AS_RENDERED,
                                                          add_generation_prompt=True)
    return token_provenance(owned, files.tokenizer)


def assert_matches_oracle(served: Any, model: ReferenceModel, reply: dict[str, Any], n_messages: int,
                          drop_message: dict[str, list[int]] | None, reposition: list[int] | None) -> None:
    prov = provenance(served, n_messages)
    rules = parse_rules(drop_message, reposition, n_messages)
    program = compile_program(prov.token_ids, prov.owners, rules, n_messages)
    entries = reply["choices"][0]["logprobs"]["content"]
    generated = np.asarray([e["token_id"] for e in entries], dtype=np.int64)
    assert reply["usage"]["prompt_tokens"] == program.n_prompt
    assert reply["usage"]["completion_tokens"] == len(entries) > 0
    result = run_program(model, append_generated(program, generated))
    log_probs = result.log_probs()
    for j, entry in enumerate(entries):
        row = log_probs[program.n_prompt - 1 + j]
        assert entry["token_id"] == int(torch.argmax(row)), f"generated token {j} is not the oracle's greedy token"
        assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=1e-4)
        top = torch.topk(row, 5)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_drops_and_repositions_are_served_exactly_cold_and_warm(served: Any, oracle_model: ReferenceModel) -> None:
    served.engine.cache.flush()
    plain = post_ok(served.url, body(4))
    assert_matches_oracle(served, oracle_model, plain, 4, None, None)

    rules = {"drop_message": {"5": [3]}, "reposition": [5]}
    second = post_ok(served.url, body(6, **rules))
    assert_matches_oracle(served, oracle_model, second, 6, rules["drop_message"], rules["reposition"])

    rules = {"drop_message": {"5": [3], "7": [5]}, "reposition": [5, 7]}
    third = post_ok(served.url, body(8, **rules))
    assert_matches_oracle(served, oracle_model, third, 8, rules["drop_message"], rules["reposition"])
    details = third["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > 0 and details["repos_tokens"] > 0 and details["drop_skipped_tokens"] > 0


def test_usage_counts_match_message_ownership(served: Any) -> None:
    """Warm messages 0..5 with a plain request; then drop message 3 at 5 and reposition there.
    Messages 0..2 are read at their stored positions (cached), message 3 is never read (skipped),
    messages 4..5 are read shifted left by message 3's length (re-rotated); messages 6..7 and the
    generation prompt are computed."""
    served.engine.cache.flush()
    post_ok(served.url, body(6))
    reply = post_ok(served.url, body(8, drop_message={"5": [3]}, reposition=[5]))
    owners = provenance(served, 8).owners
    details = reply["usage"]["prompt_tokens_details"]
    assert details == {
        "cached_tokens": int(np.isin(owners, [0, 1, 2]).sum()),
        "repos_tokens": int(np.isin(owners, [4, 5]).sum()),
        "drop_skipped_tokens": int((owners == 3).sum()),
        "computed_tokens": int((owners >= 6).sum()),
    }


def test_plain_request_reuses_its_prefix(served: Any) -> None:
    served.engine.cache.flush()
    cold = post_ok(served.url, body(4))
    warm = post_ok(served.url, body(6))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    owners = provenance(served, 6).owners
    reused = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused >= int(np.isin(owners, [0, 1, 2, 3]).sum())
    assert warm["usage"]["prompt_tokens_details"]["repos_tokens"] == 0


def test_stream_and_non_stream_agree(served: Any) -> None:
    rules = {"drop_message": {"5": [3]}, "reposition": [5]}
    complete = post_ok(served.url, body(6, **rules))
    streamed = send_chat_request(served.url, {**body(6, **rules), "stream": True}, timeout=120)
    message = complete["choices"][0]["message"]
    assert streamed.content == (message["content"] or "")
    assert streamed.finish_reason == complete["choices"][0]["finish_reason"]
    assert streamed.usage is not None
    assert streamed.usage.prompt_tokens == complete["usage"]["prompt_tokens"]
    assert streamed.usage.completion_tokens == complete["usage"]["completion_tokens"]
    # The second identical request is served from cache: everything but the last prompt token.
    details = streamed.usage.raw["prompt_tokens_details"]
    assert sum(details.values()) == complete["usage"]["prompt_tokens"] - 1
