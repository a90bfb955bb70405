"""The whole patched server on the CPU: ``python -m akv.system.launch_server`` (HTTP layer, tokenizer
manager, real scheduler, detokenizer, FP32 tiny Qwen3) against the exact CPU reference server,
request for request: the same replies and the same usage for plain and context turns, streamed
and not; bad requests answered 400 with ``param`` set and the body not echoed; without a reasoning
parser, `clear_thinking_20251015` on a conversation with thinking blocks is a 400 (SGLang leaves them
out of the prompt, so none could be kept); the server keeps serving afterwards (its strict idle leak
check would stop the scheduler otherwise)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


from bench import pd_check

from .conftest import patched_servers
from http_client import post as post_json
from http_client import post_text

pytestmark = pytest.mark.slow

MESSAGES = pd_check.MESSAGES  # the record chain, one copy
TURNS = [
    ("plain", {}),
    ("drop-and-repos", {"drop_message": {"4": [3]}, "reposition": [4]}),
    ("drop-and-repos-streamed", {"drop_message": {"4": [3]}, "reposition": [4], "stream": True,
                                 "stream_options": {"include_usage": True}}),
    ("later-drop", {"drop_message": {"4": [3], "5": [1, 2]}, "reposition": [4]}),
]


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, text = post_text(url, body, timeout=600)
    if status != 200:
        return status, json.loads(text)
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        usage = next(e["usage"] for e in events if e.get("usage"))
        return status, {"content": content, "usage": usage}
    reply = json.loads(text)
    return status, {"content": reply["choices"][0]["message"]["content"], "usage": reply["usage"]}


@pytest.fixture(scope="module")
def sglang_url(patched_site: Path, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with patched_servers(patched_site, tiny_qwen3, tmp_path_factory.mktemp("sglang-cpu-server")) as (server,):
        yield server.url


@pytest.fixture(scope="module")
def served_turns(sglang_url: str, reference_url: str) -> list[tuple[str, Any, Any]]:
    out = []
    for name, fields in TURNS:
        body = {"model": "default", "messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, **fields}
        got, want = post(sglang_url, body), post(reference_url, body)
        assert got[0] == 200 and want[0] == 200, (name, got, want)
        out.append((name, got[1], want[1]))
    return out


def test_replies_equal_the_reference_servers(served_turns: list) -> None:
    for name, got, want in served_turns:
        assert got["content"] == want["content"], name


def test_usage_equals_the_reference_servers(served_turns: list) -> None:
    for name, got, want in served_turns:
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"], name
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], name
        if name != "plain":
            details = got["usage"]["prompt_tokens_details"]
            assert set(details) == {"cached_tokens", "repos_tokens", "drop_skipped_tokens", "computed_tokens"}, name
            assert details == want["usage"]["prompt_tokens_details"], name
    streamed = dict((n, g) for n, g, _ in served_turns)["drop-and-repos-streamed"]
    assert streamed["usage"]["prompt_tokens_details"]["repos_tokens"] == 0, "the repeat reads re-rotated KV as cached"


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"drop_message": {"2": [4]}}, "drop_message", "drop_message['2'][0]: message 4 is after its anchor 2"),
        ({"reposition": [9]}, "reposition", "reposition[0]: message id 9 is out of range for 6 messages"),
        ({"drop_message": {"4": ["1"]}}, "drop_message", "drop_message['4'][0]: message id '1' is a str, not an int"),
        ({"drop_messages": {"4": [1]}}, "drop_messages", "drop_messages: unknown field"),
        ({"drop_message": {"4": [1]}, "n": 2}, "n", "n: drop_message/reposition need n == 1, got 2"),
        ({"drop_message": {"4": [1]}, "chat_template_kwargs": {"drop_message": 1}}, "chat_template_kwargs",
         "chat_template_kwargs['drop_message']: collides"),
    ],
)
def test_bad_requests_get_a_clean_400(sglang_url: str, fields: dict, param: str, needle: str) -> None:
    status, error = post(sglang_url, {"model": "default", "messages": MESSAGES, "max_tokens": 2, **fields})
    assert status == 400, error
    assert error["param"] == param and needle in error["message"], error
    assert "Record B" not in error["message"], "the request body is echoed back"


THOUGHT = [*MESSAGES[:2], {"role": "assistant", "content": "<think>A first, then B.</think>\n\nReading A."},
           *MESSAGES[3:]]
DROP_RULES = [
    ("text_drop", MESSAGES, {"drop_rule": {"type": "text_drop", "drop_messages": [
        None, {"role": "user", "content": "Read record A and follow it."}, None,
        {"role": "user", "content": ["shipment 7 left", "for the next leg"]}, None, None]}, "reposition": [5]}),
    ("keep_text_drop", [*MESSAGES[:3], {**MESSAGES[3], "content": "Record A: shipment 7 left the depot;"}, *MESSAGES[4:]],
     {"drop_rule": {"type": "keep_text_drop", "full_messages": MESSAGES}}),
    ("thinking_drop", THOUGHT, {"drop_rule": {"type": "thinking_drop"}}),
]


@pytest.mark.parametrize(("name", "messages", "fields"), DROP_RULES, ids=[d[0] for d in DROP_RULES])
def test_drop_rule_equals_the_reference_servers(sglang_url: str, reference_url: str, name: str,
                                                messages: list, fields: dict) -> None:
    body = {"model": "default", "messages": messages, "max_tokens": 6, "temperature": 0.0, **fields}
    (got_status, got), (want_status, want) = post(sglang_url, body), post(reference_url, body)
    assert got_status == want_status == 200, (got, want)
    assert got["content"] == want["content"]
    for key in ("prompt_tokens", "completion_tokens", "prompt_tokens_details"):
        assert got["usage"][key] == want["usage"][key], key
    assert got["usage"]["prompt_tokens_details"]["drop_skipped_tokens"] > 0 or name == "keep_text_drop"


def test_drop_rule_with_drop_message_is_a_400(sglang_url: str) -> None:
    status, error = post(sglang_url, {"model": "default", "messages": MESSAGES, "max_tokens": 2,
                                      "drop_rule": {"type": "thinking_drop"}, "drop_message": {"4": [3]}})
    assert status == 400 and error["param"] == "drop_rule", error
    assert "drop_rule and drop_message are exclusive" in error["message"]


def anthropic_conversation(thinking: bool) -> list[dict[str, Any]]:
    call = {"type": "tool_use", "id": "toolu_a", "name": "read_record", "input": {"id": "A"}}
    blocks = [{"type": "thinking", "thinking": "A first, then B.", "signature": "local"}, call] if thinking else [call]
    result = {"type": "tool_result", "tool_use_id": "toolu_a", "content": MESSAGES[3]["content"]}
    return [{"role": "user", "content": "Read record A and follow it."}, {"role": "assistant", "content": blocks},
            {"role": "user", "content": [result]}]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_clear_thinking_without_a_reasoning_parser_is_a_400(sglang_url: str, path: str) -> None:
    """This server runs without --reasoning-parser: SGLang's conversion leaves the thinking blocks of
    earlier turns out of the prompt, so `clear_thinking_20251015` cannot keep any. It is refused when
    the conversation has thinking blocks, and served when it has none (nothing to keep)."""
    tools = [{"name": "read_record", "description": "read a record",
              "input_schema": {"type": "object", "properties": {"id": {"type": "string"}}}}]
    edits = [{"type": "clear_thinking_20251015"}]
    body: dict[str, Any] = {"model": "default", "tools": tools, "messages": anthropic_conversation(True),
                            "context_management": {"edits": edits}}
    if path == "/v1/messages":
        body["max_tokens"] = 2
    status, error = post_json(sglang_url, body, path=path, timeout=600)
    assert status == 400 and error["error"]["type"] == "invalid_request_error", error
    message = error["error"]["message"]
    assert message.startswith("context_management.edits[0].type:") and "--reasoning-parser" in message, error
    status, reply = post_json(sglang_url, {**body, "messages": anthropic_conversation(False)}, path=path, timeout=600)
    assert status == 200, reply


def test_the_server_still_serves_after_everything(sglang_url: str, served_turns: list) -> None:
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 3, "temperature": 0.0,
            "drop_message": {"4": [3]}, "reposition": [4]}
    status, reply = post(sglang_url, body)
    assert status == 200 and reply["usage"]["prompt_tokens_details"]["drop_skipped_tokens"] > 0
