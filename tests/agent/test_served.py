"""The client against a live server: the token counter and the SSE client agree with what the server
reports, and the AKV usage counters equal their definitions.

By default these tests start the CPU reference server (`akv.system.reference_server`) on a tiny
random Qwen3 model, so they run everywhere, CI included. To target a server that is already running,
set:

- `SGLANG_BASE_URL`: its base URL, e.g. `http://127.0.0.1:30000` (any OpenAI-compatible server);
- `MODEL_DIR`: the local folder of the model it serves (tokenizer and chat template, for the
  token counter); required with `SGLANG_BASE_URL`;
- `AKV_SERVER=1`: the server is the patched (AKV) SGLang, so requests with `drop_message` /
  `reposition` are sent too and their usage details checked.

The expected counts come from `ChatTemplateTokenCounter` spans and the definitions of DESIGN.md §2,
never from the server under test."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from akv.agent import CachePolicy, TurnReposition, TurnSelection, TurnTrigger, send_chat_request

from .conversations import TOOLS, call, result

MESSAGES = [{"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "Read records A, B and C, then answer."},
            call(["A", "B"]), result("B", "record B: the value is 7"), result("A", "record A: the value is 5"),
            call("C", "search"), result("C", "search result C: nothing found"),
            {"role": "assistant", "content": "Still looking."}, {"role": "user", "content": "Continue."},
            call("D", "memory"), result("D", "memory D: stored")]

# Turn 2 ends at message 6: drop the results of turn 1 (messages 3 and 4), then reposition. Nothing else.
AKV_POLICY = CachePolicy(trigger=TurnTrigger(after=2, every=None), selector=TurnSelection(1),
                         reposition=TurnReposition(after=2, every=None))


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    model_dir: Path
    kind: str  # "reference", "akv-sglang" or "other"


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    url, model_dir = os.environ.get("SGLANG_BASE_URL"), os.environ.get("MODEL_DIR")
    if url:
        if not model_dir:
            pytest.skip("SGLANG_BASE_URL needs MODEL_DIR (the served model's local folder)")
        kind = "akv-sglang" if os.environ.get("AKV_SERVER") == "1" else "other"
        yield Target(url, served_model(url), Path(model_dir), kind)
        return
    from akv.system.models.tiny import make_tiny_model
    from akv.system.reference_server import Engine, ReferenceServer

    directory = make_tiny_model(tmp_path_factory.mktemp("served") / "tiny", seed=5)
    server = ReferenceServer(Engine(directory, name="tiny-served", kv_slots=8192))
    with server.running():
        yield Target(server.url, "tiny-served", directory, "reference")


@pytest.fixture(scope="module")
def counter(target: Target):
    from akv.agent.tokens import ChatTemplateTokenCounter

    return ChatTemplateTokenCounter.from_pretrained(target.model_dir)


def chat_payload(target: Target, messages: list, **extra) -> dict:
    return {"model": target.model, "messages": messages, "tools": TOOLS, "temperature": 0.0, **extra}


def complete_without_streaming(target: Target, payload: dict) -> dict:
    body = json.dumps({**payload, "stream": False}).encode()
    http = urllib.request.Request(f"{target.url.rstrip('/')}/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(http, timeout=120) as response:
        return json.load(response)


@pytest.mark.parametrize("thinking", [None, False])
def test_counter_prompt_tokens_equal_served_prompt_tokens(target, counter, thinking):
    for n in (2, 5, 7, len(MESSAGES)):
        payload = chat_payload(target, MESSAGES[:n], max_tokens=2)
        kwargs = None
        if thinking is not None:
            kwargs = payload["chat_template_kwargs"] = {"enable_thinking": thinking}
        layout = counter.layout(MESSAGES[:n], tools=TOOLS, chat_template_kwargs=kwargs)
        served = send_chat_request(target.url, payload, timeout=120)
        assert served.usage is not None
        assert served.usage.prompt_tokens == layout.prompt_tokens, f"first {n} messages"


def test_stream_assembles_what_the_server_answers_without_streaming(target, counter):
    payload = chat_payload(target, MESSAGES, max_tokens=16)
    served = send_chat_request(target.url, payload, timeout=120)
    plain = complete_without_streaming(target, payload)
    choice = plain["choices"][0]
    assert served.content == (choice["message"].get("content") or "")
    assert [(c.name, c.arguments) for c in served.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    assert served.finish_reason == choice["finish_reason"]
    assert served.usage.completion_tokens == plain["usage"]["completion_tokens"]
    if served.finish_reason == "length":
        assert served.usage.completion_tokens == 16
    assert served.usage.prompt_tokens == counter.layout(MESSAGES, tools=TOOLS).prompt_tokens
    assert served.usage.total_tokens == served.usage.prompt_tokens + served.usage.completion_tokens
    assert served.timings.ttft_s is not None and served.timings.total_s >= served.timings.ttft_s


def akv_payload(target: Target, messages: list = MESSAGES) -> dict:
    new, _ = AKV_POLICY.process(chat_payload(target, messages, max_tokens=4))
    assert new["drop_message"] == {"6": [3, 4]} and new["reposition"] == [6]
    return new


def test_akv_fields_are_accepted(target, counter):
    if target.kind == "other":
        pytest.skip("set AKV_SERVER=1 for a patched (AKV) server")
    served = send_chat_request(target.url, akv_payload(target), timeout=120)
    assert served.usage.prompt_tokens == counter.layout(MESSAGES, tools=TOOLS).prompt_tokens
    assert 1 <= served.usage.completion_tokens <= 4


def test_akv_usage_details_equal_their_definitions(target, counter, request):
    if target.kind == "other":
        pytest.skip("set AKV_SERVER=1 for a patched (AKV) server")
    # A system prompt no other test sends, so that only what this test computes is resident; then make
    # messages 0..6 resident: with the events at message 6, the AKV request can reuse exactly those.
    messages = [{"role": "system", "content": f"You are a careful agent ({request.node.name})."}] + MESSAGES[1:]
    send_chat_request(target.url, chat_payload(target, messages[:7], max_tokens=1), timeout=120)
    served = send_chat_request(target.url, akv_payload(target, messages), timeout=120)
    tokens = counter.layout(messages, tools=TOOLS).message_tokens
    # After the drop of 3 and 4 at message 6, every later query reads messages 0..2 at their own
    # positions, messages 5..6 re-rotated to compacted positions, and skips 3..4.
    assert served.usage.cached_tokens == sum(tokens[:3])
    assert served.usage.repos_tokens == tokens[5] + tokens[6]
    assert served.usage.drop_skipped_tokens == tokens[3] + tokens[4]
