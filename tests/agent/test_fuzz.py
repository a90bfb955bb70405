"""Fuzzing the client's entry points: whatever they are given, they return a result or raise an
`AKVError` (never a bare TypeError/KeyError/AttributeError/RecursionError), and a successful call
keeps its promises (the messages are never edited, receipts agree with the policy)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv.agent import (
    AKVError,
    ApproximateTokenCounter,
    BackendError,
    CacheOperationHistory,
    CachePolicy,
    ModelReposition,
    ModelSelection,
    ModelTrigger,
    TurnReposition,
    TurnSelection,
    send_chat_request,
)
from akv.agent.assembly import StreamAssembler
from akv.agent.results import Timings
from akv.agent.sse import SSEParser

from .conversations import TOOLS, call, result
from .sse_server import Script, serve

POLICIES = [CachePolicy(selector=TurnSelection(1), reposition=TurnReposition(after=2)),
            CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), reposition=ModelReposition(),
                        min_clear_messages=2)]

ODD = st.sampled_from([object(), {1, 2}, (1, 2), b"x", float("nan"), float("inf"), -0.0, 10**30, True, ""])
ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | ODD,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=6) | st.integers(0, 3) | st.sampled_from(["role", "content", "tool_calls", "id",
                                                                     "function", "name", "arguments",
                                                                     "tool_call_id"]), inner, max_size=4),
    max_leaves=12)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", None, 3])
CALL_ID = st.sampled_from(["A", "B", "C"])


@st.composite
def messages(draw) -> list:
    """Mostly well-formed tool conversations, with some messages replaced or mangled."""
    out: list = [{"role": "user", "content": "task"}]
    for _ in range(draw(st.integers(0, 5))):
        ids = draw(st.lists(CALL_ID, min_size=1, max_size=2, unique=True))
        out.append(call(ids, draw(st.sampled_from(["read_record", "drop_context"]))))
        out += [result(i, draw(st.text(max_size=20) | st.just('{"status": "scheduled", "message_ids": [2]}')))
                for i in ids]
    for _ in range(draw(st.integers(0, 2))):
        k = draw(st.integers(0, len(out) - 1))
        choice = draw(st.integers(0, 2)) if isinstance(out[k], dict) else 0
        if choice == 0:
            out[k] = draw(ANY)
        elif choice == 1:
            out[k] = {**out[k], draw(st.sampled_from(["role", "content", "tool_calls", "tool_call_id"])): draw(ANY)}
        else:
            out[k] = {**out[k], "role": draw(ROLE)}
    return out


def deep_nest(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(messages(), st.one_of(st.just(TOOLS), ANY), st.sampled_from(["sglang", "openai", "other"]),
       st.integers(0, 1), st.booleans())
def test_process_returns_or_raises_an_akv_error(msgs, tools, api_style, which, deep):
    if deep:
        msgs = [*msgs, {"role": "user", "content": deep_nest(5000)}]
    payload = {"model": "m", "messages": msgs, "tools": tools}
    before = copy.deepcopy(payload) if not deep else None
    try:
        new, history = POLICIES[which].process(payload, api_style=api_style)
    except AKVError:
        return
    assert new["messages"] == msgs and new["messages"] is not msgs
    if before is not None:
        assert json.dumps(payload, default=repr, sort_keys=True) == json.dumps(before, default=repr, sort_keys=True)
    back = CacheOperationHistory.from_json(history.to_json())
    again, _ = POLICIES[which].process(payload, back, api_style=api_style)
    assert again == new


@FUZZ
@given(messages(), st.one_of(ANY, st.text(max_size=30), st.builds(lambda v: json.dumps(v, default=repr), ANY)),
       st.integers(0, 1))
def test_drop_context_execute_returns_a_receipt_or_raises_an_akv_error(msgs, arguments, which):
    tool = POLICIES[which].drop_context_tool()
    msgs = [*msgs, call("Z", "drop_context")]
    try:
        receipt = tool.execute(arguments, msgs)
    except AKVError:
        return
    assert receipt["status"] in ("scheduled", "error")
    json.dumps(receipt)


@FUZZ
@given(st.one_of(st.text(max_size=60), st.builds(lambda v: json.dumps(v, default=repr), ANY)))
def test_history_from_json_returns_or_raises_a_history_error(text):
    try:
        CacheOperationHistory.from_json(text)
    except AKVError:
        pass


SSE_PIECES = st.sampled_from([
    b"data: [DONE]\n\n", b"data: {}\n\n", b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n',
    b'data: {"choices": [{"index": 1}]}\n\n', b'data: {"usage": {"prompt_tokens": 3}}\n\n', b"data: {\n\n",
    b'data: {"error": {"message": "boom"}}\n\n', b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}',
    b"event: error\n", b": comment\n", b"\r\n", b"\xff", b"data: " + b"[" * 5000 + b"\n\n", b"data", b"\n",
])


@FUZZ
@given(st.lists(SSE_PIECES, max_size=8), st.integers(1, 40))
def test_any_event_stream_assembles_or_raises_a_backend_error(pieces, split):
    body = b"".join(pieces)
    parser, assembler = SSEParser(), StreamAssembler()
    try:
        for start in range(0, len(body), split):
            for event in parser.feed(body[start:start + split]):
                assembler.accept(event)
        for event in parser.close():
            assembler.accept(event)
        assembler.result(Timings(None, None, 0.0))
    except BackendError:
        pass


@pytest.fixture(scope="module")
def loopback() -> Iterator[tuple[Script, str]]:
    script = Script()
    with serve(script) as url:
        yield script, url


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(SSE_PIECES, max_size=6), status=st.sampled_from([200, 200, 301, 404, 500]),
       content_type=st.sampled_from(["text/event-stream", "application/json", None]), end=st.booleans())
def test_send_chat_request_over_loopback_returns_or_raises_a_backend_error(loopback, pieces, status, content_type,
                                                                            end):
    script, url = loopback
    script.status, script.pieces, script.content_type, script.end = status, pieces, content_type, end
    try:
        send_chat_request(url, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    except BackendError as exc:
        assert exc.status in (None, status)


@FUZZ
@given(st.integers(1, 3), st.sampled_from([None, 10, 30]), st.lists(st.lists(st.integers(0, 14), max_size=4),
                                                                      min_size=1, max_size=6))
def test_receipts_agree_with_the_policy_over_a_growing_conversation(min_messages, min_tokens, requests):
    counter = ApproximateTokenCounter()
    policy = CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), min_clear_messages=min_messages,
                         min_clear_tokens=min_tokens, counter=counter if min_tokens else None)
    tool = policy.drop_context_tool()
    msgs: list = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    history = None
    for k, ids in enumerate(requests):
        msgs += [call(f"r{k}"), result(f"r{k}", "x" * (8 * k))]
        new, history = policy.process({"model": "m", "messages": msgs, "tools": TOOLS}, history)
        msgs.append(call(f"d{k}", "drop_context"))
        receipt = tool.execute({"message_ids": ids}, msgs, history, tools=TOOLS)
        msgs.append({"role": "tool", "tool_call_id": f"call_d{k}", "content": json.dumps(receipt)})
        hidden_before = history.hidden
        new, history = policy.process({"model": "m", "messages": msgs, "tools": TOOLS}, history)
        added = history.hidden - hidden_before
        if receipt["status"] == "scheduled":
            assert added == set(ids) and history.operations[-1].boundary == len(msgs) - 1
        else:
            assert added == set()
            if set(receipt) - {"status", "error"}:  # the ids parsed; each problem id is named
                assert set(receipt.get("already_dropped", [])) == set(ids) & hidden_before
            assert "already_requested" not in receipt, "with ModelTrigger every scheduled request is dropped at once"
