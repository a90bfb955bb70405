"""The patched request/usage models, imported from the installed wheels under the CPU shim.

Each wheel is imported in its own process (both are the package ``sglang``): stock parses are the
reference that plain requests must reproduce; AKV fields are checked against the wire rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_probe

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                          "parameters": {"type": "object",
                                                         "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, cloudy"},
    {"role": "user", "content": "And tomorrow?"},
]

PLAIN = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": CONVERSATION, "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True},
     "temperature": 0, "max_tokens": 16},
    {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "required", "n": 2, "seed": 3, "top_k": 5},
    {"messages": CONVERSATION, "reasoning_effort": "low", "logprobs": True, "top_logprobs": 2,
     "unknown_field": {"x": 1}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
     "response_format": {"type": "json_object"}, "stop": ["\n"]},
    {"messages": CONVERSATION, "drop_message": {}},
]

CONTEXT_OK = [
    ({"1": [1], "3": [3]}, [3]),
    ({"4": [0, 3, 1]}, None),
    (None, [0, 2, 4]),
    ({"3": [2]}, [3, 4]),
]

# (drop_message, reposition, text the error must contain: the field and the offending value)
CONTEXT_BAD = [
    ({"1": [2]}, None, "drop_message['1'][0]: message 2 is after its anchor 1"),
    ({"5": [0]}, None, "drop_message['5']: message id 5 is out of range for 5 messages"),
    ({"2": [0], "3": [0]}, None, "drop_message['3'][0]: message 0 is already dropped by anchor 2"),
    ({"2": [1, 1]}, None, "drop_message['2'][1]: message 1 is already dropped earlier in this list"),
    ({"02": [0]}, None, "drop_message['02']: key '02' is not a message id"),
    ({"2": []}, None, "drop_message['2']: empty list"),
    ({"2": ["0"]}, None, "drop_message['2'][0]: message id '0' is a str, not an int"),
    ({"2": [True]}, None, "drop_message['2'][0]: message id True is a bool, not an int"),
    ({"2": [-1]}, None, "drop_message['2'][0]: message id -1 is negative"),
    ([[2, 0]], None, "drop_message: expected an object, got list"),
    (None, [2, 2], "reposition[1]: anchor 2 is not greater than the previous anchor 2"),
    (None, [3, 1], "reposition[1]: anchor 1 is not greater than the previous anchor 3"),
    (None, [7], "reposition[0]: message id 7 is out of range for 5 messages"),
    (None, ["1"], "reposition[0]: message id '1' is a str, not an int"),
    (None, 1, "reposition: expected a list of message ids, got int"),
]

# misspelt AKV fields: refused instead of silently served as plain requests
MISSPELT = [
    ({"drop_messages": {"2": [0]}}, "drop_messages: unknown field; AKV's cache operations are 'drop_message'"),
    ({"repositions": [2]}, "repositions: unknown field"),
    ({"drop_message": {"2": [0]}, "Drop_Message": {"2": [1]}}, "Drop_Message: unknown field"),
    ({"akv_dryrun": True}, "akv_dryrun: unknown field"),
]


def _context_body(drop_message, reposition) -> dict:
    body: dict = {"messages": CONVERSATION, "tools": TOOLS}
    if drop_message is not None:
        body["drop_message"] = drop_message
    if reposition is not None:
        body["reposition"] = reposition
    return body


@pytest.fixture(scope="module")
def results(stock_site: Path, patched_site: Path) -> dict[str, dict]:
    details = [{"cached_tokens": 0}, {"cached_tokens": 5}, {"cached_tokens": 3, "image_tokens": 2}]
    patched_payload = {
        "requests": PLAIN + [_context_body(d, r) for d, r in CONTEXT_OK]
        + [_context_body(d, r) for d, r, _ in CONTEXT_BAD]
        + [{"messages": CONVERSATION, **fields} for fields, _ in MISSPELT],
        "details": details + [{"cached_tokens": 4, "repos_tokens": 6, "drop_skipped_tokens": 0, "computed_tokens": 3},
                              {"cached_tokens": 1, "repos_tokens": None, "drop_skipped_tokens": 9}],
    }
    return {"stock": run_probe(stock_site, {"requests": PLAIN, "details": details}),
            "patched": run_probe(patched_site, patched_payload)}


def test_versions(results: dict[str, dict]) -> None:
    assert results["stock"]["version"] == "0.5.16"
    assert results["patched"]["version"] == "0.5.16+akv"


def test_plain_requests_parse_exactly_as_stock(results: dict[str, dict]) -> None:
    stock = results["stock"]["requests"]
    patched = results["patched"]["requests"][: len(PLAIN)]
    for body, s, p in zip(PLAIN, stock, patched):
        assert s["ok"] and p["ok"], (body, s["error"], p["error"])
        extra = {k: p["dump"].pop(k) for k in ("drop_message", "reposition", "drop_rule", "akv_unknown_fields",
                                                "akv_dry_run")}
        assert p["dump"] == s["dump"], body
        assert extra == {"drop_message": body.get("drop_message"), "reposition": None, "drop_rule": None,
                         "akv_unknown_fields": None, "akv_dry_run": None}


def test_usage_serializes_as_stock_and_adds_only_set_counters(results: dict[str, dict]) -> None:
    stock, patched = results["stock"]["details"], results["patched"]["details"]
    assert patched[: len(stock)] == stock
    assert ('"prompt_tokens_details":{"cached_tokens":4,"repos_tokens":6,"drop_skipped_tokens":0,'
            '"computed_tokens":3}') in patched[3]
    assert '"prompt_tokens_details":{"cached_tokens":1,"drop_skipped_tokens":9}' in patched[4]


def test_context_fields_are_accepted_as_sent(results: dict[str, dict]) -> None:
    start = len(PLAIN)
    for (drop_message, reposition), out in zip(CONTEXT_OK, results["patched"]["requests"][start:]):
        assert out["ok"], out["error"]
        assert out["dump"]["drop_message"] == drop_message
        assert out["dump"]["reposition"] == reposition


def test_bad_context_fields_are_rejected_naming_field_and_value(results: dict[str, dict]) -> None:
    start = len(PLAIN) + len(CONTEXT_OK)
    for (drop_message, reposition, message), out in zip(CONTEXT_BAD, results["patched"]["requests"][start:]):
        assert not out["ok"], (drop_message, reposition)
        assert message in out["error"], (message, out["error"])


def test_misspelt_akv_fields_are_refused_naming_the_field(results: dict[str, dict]) -> None:
    outs = results["patched"]["requests"][len(PLAIN) + len(CONTEXT_OK) + len(CONTEXT_BAD):]
    assert len(outs) == len(MISSPELT)
    for (fields, message), out in zip(MISSPELT, outs):
        assert not out["ok"], fields
        assert out["error"].startswith(message.split(";")[0]) and message in out["error"], out["error"]
