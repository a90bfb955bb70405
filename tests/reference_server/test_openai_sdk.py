"""The OpenAI Python SDK drives the reference server; AKV fields travel through ``extra_body``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from akv.agent import CachePolicy, TurnReposition, TurnSelection, TurnTrigger, extra_body

openai = pytest.importorskip("openai")

MODEL = "tiny-test"


def _turn(i: int) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function",
            "function": {"name": "read_record", "arguments": json.dumps({"record_id": f"R{i}"})}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"record R{i}: " + "crates of tea; " * 30}]


def test_sdk_with_policy_fields_in_extra_body(served: Any) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Follow the records."}, *_turn(1), *_turn(2), *_turn(3)]
    policy = CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(1), reposition=TurnReposition())
    payload = {"model": MODEL, "messages": messages}
    _, history = policy.process(payload, api_style="openai")
    fields = extra_body(history)
    assert fields == {"drop_message": {"4": [2], "6": [4]}, "reposition": [4, 6]}

    served.engine.cache.flush()
    client.chat.completions.create(model=MODEL, messages=messages[:5], max_tokens=2)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=fields)
    details = reply.usage.prompt_tokens_details
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert details.cached_tokens > 0
    assert details.model_extra["drop_skipped_tokens"] > 0 and details.model_extra["repos_tokens"] > 0

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=fields,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (reply.choices[0].message.content or "")

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"reposition": [9]})
    assert "reposition[0]" in str(info.value)
