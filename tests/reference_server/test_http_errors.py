"""Bad requests get HTTP 400 naming the field and value; the server keeps serving, its cache untouched."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from akv.agent.errors import ContextLengthError, HTTPStatusError
from akv.agent import send_chat_request
import http_client

MODEL = "tiny-test"
CALL = {"id": "c1", "type": "function", "function": {"name": "read_record", "arguments": '{"record_id": "A"}'}}
MESSAGES = [
    {"role": "user", "content": "Follow the records."},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "record A says go to B"},
]


def good_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": copy.deepcopy(MESSAGES), "max_tokens": 6, **extra}


def post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    return http_client.post(url, raw if raw is not None else body, timeout=60)


def get(url: str, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _with(path: list[Any], value: Any) -> dict[str, Any]:
    body = good_body()
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


BAD_REQUESTS = [
    ("unknown field", good_body(drop_messages={"2": [2]}), "drop_messages", "drop_messages"),
    ("wrong model", good_body(model="gpt-4o"), "model", "gpt-4o"),
    ("no messages", _with(["messages"], []), "messages", "non-empty"),
    ("bad role", _with(["messages", 0, "role"], "robot"), "messages[0].role", "robot"),
    ("args not json", _with(["messages", 1, "tool_calls", 0, "function", "arguments"], "{oops"),
     "messages[1].tool_calls[0].function.arguments", "{oops"),
    ("drop id out of range", good_body(drop_message={"2": [7]}), "drop_message['2'][0]", "7"),
    ("anchor out of range", good_body(drop_message={"5": [1]}), "drop_message['5']", "5"),
    ("future drop", good_body(drop_message={"1": [2]}), "drop_message['1'][0]", "after its anchor"),
    ("double drop", good_body(drop_message={"1": [1], "2": [1]}), "drop_message['2'][0]", "already dropped"),
    ("drop ids not ints", good_body(drop_message={"2": ["1"]}), "drop_message['2'][0]", "'1'"),
    ("reposition not increasing", good_body(reposition=[2, 1]), "reposition[1]", "not greater"),
    ("reposition out of range", good_body(reposition=[3]), "reposition[0]", "3"),
    ("drop_rule", good_body(drop_rule={"type": "message_drop"}), "drop_rule.drop_messages", "needs drop_messages"),
    ("max_tokens zero", good_body(max_tokens=0), "max_tokens", "0"),
    ("temperature", good_body(temperature=-1), "temperature", "-1"),
    ("top_logprobs alone", good_body(top_logprobs=3), "top_logprobs", "logprobs"),
    ("n > 1", good_body(n=2), "n", "2"),
    ("n true", good_body(n=True), "n", "True"),
    ("n float", good_body(n=1.0), "n", "1.0"),
    ("penalty false", good_body(presence_penalty=False), "presence_penalty", "False"),
    ("seed too large", good_body(seed=10**30, temperature=1.0), "seed", str(10**30)),
    ("seed too small", good_body(seed=-(2**63) - 1), "seed", str(-(2**63) - 1)),
    *[(f"template kwarg {key}", good_body(chat_template_kwargs={key: value}), f"chat_template_kwargs.{key}",
       "set by the server") for key, value in (("messages", []), ("tools", None), ("add_generation_prompt", False),
                                               ("tokenize", True), ("documents", []))],
    ("tool call without a name", _with(["messages", 1, "tool_calls", 0, "function"], {"arguments": "{}"}),
     "messages[1].tool_calls[0].function.name", "function name"),
    ("tool call with an empty name", _with(["messages", 1, "tool_calls", 0, "function", "name"], ""),
     "messages[1].tool_calls[0].function.name", "function name"),
    ("lone surrogate", _with(["messages", 0, "content"], "half \ud83d of a pair"), "messages[0].content",
     "surrogate"),
    ("lone surrogate in a key", good_body(chat_template_kwargs={"\udc00": 1}), "chat_template_kwargs",
     "surrogate"),
    ("tool result without a call", _with(["messages", 1], {"role": "user", "content": "go on"}), "messages[2]",
     "must follow an assistant message with tool_calls"),
    ("tool result for another call", _with(["messages", 2, "tool_call_id"], "c9"), "messages[2].tool_call_id",
     "'c9'"),
    ("max_tokens beyond the pool", good_body(max_tokens=20000), "max_tokens", "20000"),
]


@pytest.mark.parametrize(("case", "body", "field", "mentions"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_field(served: Any, case: str, body: dict[str, Any], field: str,
                                             mentions: str) -> None:
    status, reply = post(served.url, body)
    assert status == 400, reply
    assert reply["error"]["param"] == field
    assert reply["error"]["message"].startswith(field + ":")
    assert mentions in reply["error"]["message"]


def test_malformed_bodies_are_400(served: Any) -> None:
    status, reply = post(served.url, None, raw=b"{not json")
    assert (status, reply["error"]["param"]) == (400, "body")
    status, reply = post(served.url, ["a", "list"])
    assert (status, reply["error"]["param"]) == (400, "body")


def test_bad_requests_do_not_disturb_the_server_or_its_cache(served: Any) -> None:
    body = good_body(drop_message={"2": [1]}, reposition=[2], logprobs=True)
    first_status, first = post(served.url, body)
    assert first_status == 200
    for _, bad, _, _ in BAD_REQUESTS:
        assert post(served.url, bad)[0] == 400
    status, again = post(served.url, body)
    assert status == 200
    ids = [entry["token_id"] for entry in again["choices"][0]["logprobs"]["content"]]
    assert ids == [entry["token_id"] for entry in first["choices"][0]["logprobs"]["content"]]
    # The identical request now finds its whole prompt resident except the last token, which always runs.
    prompt = again["usage"]["prompt_tokens"]
    details = again["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] + details["repos_tokens"] + details["drop_skipped_tokens"] == prompt - 1


def test_context_length_error_reaches_the_client_as_such(served: Any) -> None:
    body = good_body(stream=True)
    body["messages"][0]["content"] = "many words " * 6000
    with pytest.raises(ContextLengthError) as info:
        send_chat_request(served.url, body, timeout=60)
    assert info.value.status == 400


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_deeply_nested_json_is_a_400_naming_where(served: Any) -> None:
    status, reply = post(served.url, None, raw=b"[" * 100_000 + b"]" * 100_000)
    assert (status, reply["error"]["param"]) == (400, "body")
    status, reply = post(served.url, good_body(chat_template_kwargs={"x": nested(100)}))
    assert status == 400 and reply["error"]["param"].startswith("chat_template_kwargs.x[0][0]")
    assert "nested deeper" in reply["error"]["message"]
    arguments = '{"a": ' + "[" * 5000 + "1" + "]" * 5000 + "}"  # a string, parsed when rendering
    status, reply = post(served.url, _with(["messages", 1, "tool_calls", 0, "function", "arguments"], arguments))
    assert status == 400 and reply["error"]["param"].startswith("messages")
    status, reply = post(served.url, good_body(chat_template_kwargs={"x": nested(40)}))
    assert status == 200, reply


def test_health_models_and_unknown_routes(served: Any) -> None:
    assert get(served.url, "/health") == (200, {"status": "ok"})
    status, models = get(served.url, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    status, reply = get(served.url, "/v2/nothing")
    assert status == 404 and "/v2/nothing" in reply["error"]["message"]


def test_engine_failure_is_reported_and_the_server_recovers(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("simulated engine fault")

    monkeypatch.setattr(served.engine, "generate", broken)
    status, reply = post(served.url, good_body())
    assert status == 500 and "simulated engine fault" in reply["error"]["message"]
    # Before the first token the stream has not started: a plain HTTP 500.
    with pytest.raises(HTTPStatusError, match="simulated engine fault") as info:
        send_chat_request(served.url, good_body(stream=True), timeout=60)
    assert info.value.status == 500
    monkeypatch.undo()
    assert post(served.url, good_body())[0] == 200
