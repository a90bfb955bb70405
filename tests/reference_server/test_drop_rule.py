"""drop_rule served by the reference server: replies equal the semantic oracle's for text, projection
and thinking drops; keep_text_drop serves a trimmed conversation exactly as the full one with the
equivalent drop_message, reusing the full conversation's KV; thinking_drop on the Qwen3 template
hides the reasoning from later queries (usage and the oracle agree) while the answer is still read."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from akv.agent import CachePolicy, TurnSelection, TurnTrigger, keep_text_payload
from akv.agent.templating import template_messages
from akv.system.context.compiler import append_generated
from akv.system.context.request import compile_request
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_program
from akv.system.reference_server import Engine, ReferenceServer
from akv.system.reference_server.model_dir import load_model_dir

from .conftest import MODEL_NAME
from http_client import post

QWEN3_TEMPLATE = Path(__file__).parents[1] / "context" / "templates" / "qwen3.jinja"

CHAT = [
    {"role": "system", "content": "You follow record chains."},
    {"role": "user", "content": "Read record A and follow it."},
    {"role": "assistant", "content": "Reading A."},
    {"role": "user", "content": "Record A: shipment 7 left the depot at dawn; see record B for the next leg."},
    {"role": "assistant", "content": "Reading B."},
    {"role": "user", "content": "Record B: the shipment arrived; the chain ends here."},
]
CALL = {"id": "c1", "type": "function", "function": {"name": "read_record", "arguments": "{\"id\": \"A\"}"}}
AGENT = [
    {"role": "system", "content": "You follow shipment records."},
    {"role": "user", "content": "Where is shipment 7?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "record A: 7 crates left the depot; next record B"},
    {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "c2"}]},
    {"role": "tool", "tool_call_id": "c2", "content": "record B: arrived at dock 9; chain ends"},
    {"role": "assistant", "content": "It is at dock 9."},
    {"role": "user", "content": "Thanks. Which dock again?"},
]


def ask(url: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    status, reply = post(url, {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "logprobs": True,
                               **fields})
    assert status == 200, reply
    return reply


def generated(reply: dict[str, Any]) -> list[int]:
    return [e["token_id"] for e in reply["choices"][0]["logprobs"]["content"]]


def assert_oracle_agrees(model_dir: Path, model: ReferenceModel, reply: dict[str, Any], messages: list[dict[str, Any]],
                         **fields: Any) -> Any:
    """Compile the request on its own, run the oracle over it plus the reply, compare every logprob."""
    files = load_model_dir(model_dir)
    rule = fields.get("drop_rule")
    if rule is not None and rule.get("type") == "keep_text_drop":
        rule = {**rule, "full_messages": template_messages(rule["full_messages"])}
    compiled = compile_request(files.tokenizer, template_messages(messages), template=files.chat_template,
                               drop_message=fields.get("drop_message"), reposition=fields.get("reposition"),
                               drop_rule=rule)
    program = compiled.program
    assert reply["usage"]["prompt_tokens"] == program.n_prompt
    tokens = generated(reply)
    log_probs = run_program(model, append_generated(program, np.asarray(tokens, dtype=np.int64))).log_probs()
    for j, entry in enumerate(reply["choices"][0]["logprobs"]["content"]):
        row = log_probs[program.n_prompt - 1 + j]
        assert entry["token_id"] == int(torch.argmax(row)), j
        assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=1e-4), j
    return compiled


@pytest.fixture(scope="module")
def oracle_model(served: Any) -> ReferenceModel:
    return ReferenceModel.from_pretrained(served.model_dir)


def text_rule(entries: dict[int, Any], n: int) -> dict[str, Any]:
    return {"type": "text_drop", "drop_messages": [entries.get(i) for i in range(n)]}


def test_text_drop_is_served_as_the_oracle_computes(served: Any, oracle_model: ReferenceModel) -> None:
    served.engine.cache.flush()
    ask(served.url, CHAT[:4])
    rule = text_rule({1: {"role": "user", "content": "Read record A and follow it."},
                      3: {"role": "user", "content": ["shipment 7 left", "at dawn"]}}, len(CHAT))
    reply = ask(served.url, CHAT, drop_rule=rule, reposition=[5])
    compiled = assert_oracle_agrees(served.model_dir, oracle_model, reply, CHAT, drop_rule=rule, reposition=[5])
    details = reply["usage"]["prompt_tokens_details"]
    assert details["drop_skipped_tokens"] == int((~compiled.program.keep).sum()) > 0
    assert details["repos_tokens"] > 0


def test_keep_text_drop_serves_the_trimmed_conversation_as_the_full_one(served: Any, oracle_model: ReferenceModel
                                                                       ) -> None:
    trimmed = AGENT[:3] + AGENT[4:5] + AGENT[6:]  # old tool results removed, as a trimming harness does
    rule = {"type": "keep_text_drop", "full_messages": AGENT}
    equivalent = {"drop_message": {"7": [3, 5]}}
    replies = []
    for fields in ({"drop_rule": rule}, equivalent):
        served.engine.cache.flush()
        ask(served.url, AGENT[:7])  # the earlier turn, untrimmed
        replies.append((fields, ask(served.url, trimmed if "drop_rule" in fields else AGENT, **fields)))
    (_, kept), (_, plain) = replies
    assert generated(kept) == generated(plain)
    assert kept["usage"] == plain["usage"]
    compiled = assert_oracle_agrees(served.model_dir, oracle_model, kept, trimmed, drop_rule=rule)
    owners = compiled.provenance.owners
    details = kept["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] >= int(np.isin(owners, [0, 1, 2, 4, 6]).sum())
    assert details["drop_skipped_tokens"] == int(np.isin(owners, [3, 5]).sum())


def test_keep_text_drop_partial_message_and_forced_fallback(served: Any, oracle_model: ReferenceModel) -> None:
    trimmed = [*AGENT[:3], {**AGENT[3], "content": "record A: 7 crates"}, *AGENT[4:]]
    rule = {"type": "keep_text_drop", "full_messages": AGENT}
    reply = ask(served.url, trimmed, drop_rule=rule)
    assert_oracle_agrees(served.model_dir, oracle_model, reply, trimmed, drop_rule=rule)

    rewritten = [*AGENT[:3], {**AGENT[3], "content": "[trimmed]"}, *AGENT[4:]]
    status, error = post(served.url, {"model": MODEL_NAME, "messages": rewritten, "drop_rule": rule})
    assert status == 400 and error["error"]["param"] == "messages[3]", error
    forced = {**rule, "force": True}
    reply = ask(served.url, rewritten, drop_rule=forced)
    plain = ask(served.url, rewritten)
    assert generated(reply) == generated(plain)
    assert reply["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert set(reply["usage"]["prompt_tokens_details"]) == {"cached_tokens", "repos_tokens", "drop_skipped_tokens",
                                                                "computed_tokens"}


def thinking_call(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"<think>record {i} is next</think>\n\n",
            "tool_calls": [{**CALL, "id": f"c{i}"}]}


def test_policy_reasoning_schedule_is_served_as_the_oracle_computes(served: Any, oracle_model: ReferenceModel
                                                                    ) -> None:
    messages = [AGENT[0], AGENT[1]]
    for i in range(3):
        messages += [thinking_call(i), {"role": "tool", "tool_call_id": f"c{i}", "content": f"record {i}: crates"}]
    policy = CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(2), keep_thinking_turns=1)
    served.engine.cache.flush()
    history = None
    for n in (4, 6, 8):
        body, history = policy.process({"model": MODEL_NAME, "messages": messages[:n], "max_tokens": 6,
                                        "logprobs": True}, history)
        status, reply = post(served.url, body)
        assert status == 200, reply
    assert body["drop_rule"]["thinking"] == {"5": [2], "7": [4]}
    fields = {k: body[k] for k in ("drop_rule", "reposition") if k in body}
    compiled = assert_oracle_agrees(served.model_dir, oracle_model, reply, messages, **fields)
    assert reply["usage"]["prompt_tokens_details"]["drop_skipped_tokens"] == int((~compiled.program.keep).sum()) > 0


def test_keep_text_payload_is_served_from_the_full_conversation(served: Any) -> None:
    trimmed = [*AGENT[:3], {**AGENT[3], "content": "record A: 7 crates"}, *AGENT[4:]]
    served.engine.cache.flush()
    ask(served.url, AGENT[:7])
    body = keep_text_payload({"model": MODEL_NAME, "messages": trimmed, "max_tokens": 6, "logprobs": True}, AGENT)
    status, reply = post(served.url, body)
    assert status == 200, reply
    details = reply["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > 0 and details["drop_skipped_tokens"] > 0


def test_bad_drop_rules_are_400s_naming_the_field(served: Any) -> None:
    cases = [
        ({"drop_rule": {"type": "thinking_drop"}, "drop_message": {"1": [0]}}, "drop_rule", "exclusive"),
        ({"drop_rule": text_rule({3: {"role": "user", "content": "no such text"}}, len(CHAT))},
         "drop_rule.drop_messages[3].content", "not in messages[3].content"),
        ({"drop_rule": {"type": "keep_text_drop", "full_messages": [{"role": "robot", "content": "x"}]}},
         "drop_rule.full_messages[0].role", "robot"),
    ]
    for fields, param, needle in cases:
        status, error = post(served.url, {"model": MODEL_NAME, "messages": CHAT, **fields})
        assert status == 400 and error["error"]["param"] == param and needle in error["error"]["message"], error


@pytest.fixture(scope="module")
def qwen3_served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    model_dir = tmp_path_factory.mktemp("qwen3-template") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(QWEN3_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    engine = Engine(model_dir, name=MODEL_NAME, kv_slots=4096)
    server = ReferenceServer(engine)
    with server.running():
        yield server.url, engine


THINKING = [
    {"role": "user", "content": "Where is shipment 7?"},
    {"role": "assistant", "reasoning_content": "Record A says the depot; record B says dock 9.",
     "content": "Dock 9."},
    {"role": "user", "content": "And shipment 8?"},
]


def test_thinking_drop_on_the_qwen3_template(qwen3_served: tuple[str, Engine]) -> None:
    url, engine = qwen3_served
    model = ReferenceModel.from_pretrained(engine.files.path)
    engine.cache.flush()
    ask(url, THINKING[:2])  # the turn that produced the reasoning: Qwen3 renders it there
    rule = {"drop_rule": {"type": "thinking_drop"}}
    reply = ask(url, THINKING, **rule)
    compiled = assert_oracle_agrees(engine.files.path, model, reply, THINKING, **rule)
    prov, program = compiled.provenance, compiled.program
    block = "<think>\nRecord A says the depot; record B says dock 9.\n</think>\n\n"
    start = prov.text.index(block)
    inside = [t for t in range(program.n_prompt)
              if start <= prov.offsets[t][0] < prov.offsets[t][1] <= start + len(block)]
    assert np.flatnonzero(~program.keep).tolist() == inside
    answer = [t for t in range(program.n_prompt) if prov.offsets[t][0] >= start + len(block) and prov.owners[t] == 1]
    assert answer and program.keep[answer].all() and program.visible_until[inside].max() <= answer[-1] + 1
    details = reply["usage"]["prompt_tokens_details"]
    assert details["drop_skipped_tokens"] == len(inside)
    assert details["cached_tokens"] >= int((prov.owners <= 1).sum()) - len(inside)
    plain = ask(url, THINKING)  # without the rule, Qwen3 leaves the earlier reasoning out of the prompt
    assert plain["usage"]["prompt_tokens"] < reply["usage"]["prompt_tokens"]
