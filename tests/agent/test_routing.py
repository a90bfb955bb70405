"""The conversation routing key: forks of one conversation share it, other conversations do not, it
stays fixed as a branch grows, and both ways of sending carry it (send_chat_request's header, the
history's ``routing_key`` for harnesses that send requests themselves)."""

from __future__ import annotations

import json

import pytest

from akv.agent import (
    ROUTING_HEADER,
    CacheOperationHistory,
    CachePolicy,
    PayloadError,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
    routing_key,
    send_chat_request,
)

from .sse_server import Script, serve

TOOLS = [{"type": "function", "function": {"name": "read_record", "parameters": {"type": "object"}}}]


def call(i: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "read_record", "arguments": f'{{"id": "{i}"}}'}}]}


def result(i: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": f"record {i}: next is {i}{i}"}


ROOT = [{"role": "system", "content": "You follow record chains."}, {"role": "user", "content": "Read A."}]
TRUNK = [*ROOT, call("A"), result("A")]
FORK_1 = [*TRUNK, call("B"), result("B"), call("C"), result("C")]
FORK_2 = [*TRUNK, call("X"), result("X")]
FORK_3 = [*ROOT, {"role": "assistant", "content": "I will not read anything."}, {"role": "user", "content": "Please."}]


def payload(messages: list, **settings) -> dict:
    return {"model": "m", "tools": TOOLS, "messages": messages, **settings}


def policy() -> CachePolicy:
    return CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(1), reposition=TurnReposition(after=1, every=1))


def test_forks_of_one_conversation_share_the_key() -> None:
    keys = {routing_key(payload(m)) for m in (ROOT, TRUNK, FORK_1, FORK_2, FORK_3, FORK_1[:5])}
    assert len(keys) == 1


@pytest.mark.parametrize("change", [
    {"messages": [ROOT[0], {"role": "user", "content": "Read B."}, *TRUNK[2:]]},
    {"messages": [{"role": "system", "content": "You read records."}, *TRUNK[1:]]},
    {"messages": TRUNK[1:]},
    {"model": "other"},
    {"tools": []},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "low"},
], ids=["first-user-message", "system-message", "no-system-message", "model", "tools", "template-kwargs",
        "reasoning-effort"])
def test_another_root_or_setting_is_another_conversation(change: dict) -> None:
    assert routing_key({**payload(TRUNK), **change}) != routing_key(payload(TRUNK))


def test_settings_under_extra_body_count_as_top_level() -> None:
    top = payload(TRUNK, chat_template_kwargs={"enable_thinking": False})
    sdk = {"model": "m", "tools": TOOLS, "messages": TRUNK, "extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                                                                          "drop_message": {"3": [3]}}}
    assert routing_key(sdk) == routing_key(top)


def test_a_conversation_without_a_user_message_is_rooted_in_all_its_messages() -> None:
    system_only = [{"role": "system", "content": "s"}]
    assert routing_key(payload(system_only)) != routing_key(payload([*system_only, {"role": "assistant", "content": "a"}]))


def test_the_history_carries_the_key_across_turns_branches_and_json() -> None:
    p = policy()
    sent, history = p.process(payload(TRUNK))
    assert history.routing_key == routing_key(payload(TRUNK))
    first_key = history.routing_key
    for fork in (FORK_1, FORK_2):
        saved = CacheOperationHistory.from_json(history.to_json())
        assert saved.routing_key == first_key
        sent, branch = p.process(payload(fork), saved)
        assert branch.routing_key == first_key and "drop_message" in sent
    _, sdk_history = p.process(payload(TRUNK), api_style="openai")
    assert sdk_history.routing_key == first_key
    other = p.process(payload([ROOT[0], {"role": "user", "content": "Read Z."}]))[1]
    assert other.routing_key != first_key


def test_a_history_saved_without_a_key_gets_it_on_the_next_call() -> None:
    p = policy()
    _, history = p.process(payload(TRUNK))
    data = json.loads(history.to_json())
    del data["routing_key"]
    old = CacheOperationHistory.from_json(json.dumps(data))
    assert old.routing_key is None and old == history
    assert p.process(payload(TRUNK), old)[1].routing_key == history.routing_key
    assert p.process(payload(FORK_2), old)[1].routing_key == history.routing_key


def test_send_chat_request_sends_the_key_unless_the_caller_names_one() -> None:
    stream = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}\n\n' \
             b"data: [DONE]\n\n"
    script = Script(pieces=[stream])
    with serve(script) as url:
        send_chat_request(url, payload(FORK_1))
        send_chat_request(url, payload(FORK_2), headers={"X-SMG-Routing-Key": "mine"})
    sent = [{k.lower(): v for k, v in h.items()} for h in script.headers]
    assert sent[0][ROUTING_HEADER] == routing_key(payload(TRUNK))
    assert sent[1][ROUTING_HEADER] == "mine"


@pytest.mark.parametrize(("bad", "field"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": {1, 2}}]}, "messages[0].content"),
    ({"messages": TRUNK, "tools": [object()]}, "tools[0]"),
])
def test_a_payload_without_a_root_is_a_payload_error(bad: dict, field: str) -> None:
    with pytest.raises(PayloadError) as error:
        routing_key(bad)
    assert error.value.field == field
