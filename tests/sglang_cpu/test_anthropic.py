"""The patched SGLang's `/v1/messages` on the CPU, driven by the official `anthropic` SDK: a multi-turn
tool-use conversation with `clear_tool_uses_20250919` gets, turn for turn, the reply and usage the
exact reference server gives the equivalent OpenAI-path drop program (written by hand here); with
thinking blocks in the earlier turns, `clear_thinking_20251015` gets the reply and usage of its
`thinking_drop` program, whose reference reply is checked against the oracle token by token (the
server runs with `--reasoning-parser qwen3`, without which SGLang leaves thinking blocks out of the
prompt); `applied_edits` equal a count from the message list; streaming parses with the SDK;
`count_tokens` gives the prompt before and after the edits of the request that follows and, planned
against the cache, what it will read, re-rotate, compute and drop (as the reference server's dry run
does); a dry run (`count_tokens`, `akv_dry_run` on chat completions) leaves the pool and the tree as
they were; bad edits are 400s naming the field, and the server keeps serving (its strict idle leak
check would stop the scheduler otherwise)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import pytest
import torch

from akv.agent.templating import template_messages, template_tools
from akv.system.context.compiler import append_generated
from akv.system.context.request import compile_request
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_program
from akv.system.reference_server.model_dir import ModelDir, load_model_dir

from .conftest import patched_servers
from anthropic_conversation import OPENAI_TOOLS, TOOLS, anthropic_messages, openai_messages
from http_client import post, post_ok

pytestmark = pytest.mark.slow

N_TURNS = 4
KEEP = 1
EDITS = [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
          "keep": {"type": "tool_uses", "value": KEEP}}]


def equivalent(n_turns: int) -> dict[str, Any]:
    """The OpenAI-path request the edits mean (user 0; turn i: call 2i+1, result 2i+2): from the third
    tool result on (more than 2 tool uses), every result but the newest is dropped at each batch."""
    messages = openai_messages(n_turns)
    drops: dict[str, list[int]] = {}
    dropped: set[int] = set()
    for k in range(3, n_turns + 1):
        new = [2 * j for j in range(1, k) if 2 * j not in dropped]
        if new:
            drops[str(2 * k)] = new
            dropped.update(new)
    body: dict[str, Any] = {"model": "default", "messages": messages, "tools": OPENAI_TOOLS, "max_tokens": 5,
                            "temperature": 0.0}
    if drops:
        body["drop_message"] = drops
    return body


AKV_COUNTERS = ("cached_tokens", "repos_tokens", "computed_tokens", "drop_skipped_tokens")


def dry_run_counters(url: str, n_turns: int) -> dict[str, int]:
    """`count_tokens`'s dry-run counters for turn ``n_turns`` of the conversation with the edits."""
    body = {"model": "default", "tools": TOOLS, "messages": anthropic_messages(n_turns),
            "context_management": {"edits": EDITS}}
    counted = post_ok(url, body, path="/v1/messages/count_tokens", timeout=600)
    return counted["akv"]


def server_info(url: str) -> dict[str, int]:
    """The scheduler's KV split (live, cached, free) and request counts."""
    with urllib.request.urlopen(f"{url}/server_info", timeout=60) as response:
        return json.loads(response.read())["internal_states"][0]["akv"]


@pytest.fixture(scope="module")
def sglang_url(patched_site: Path, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with patched_servers(patched_site, tiny_qwen3, tmp_path_factory.mktemp("sglang-cpu-anthropic"),
                         args=("--chunked-prefill-size", "64", "--enable-cache-report",
                               "--reasoning-parser", "qwen3")) as (server,):
        yield server.url


@pytest.fixture(scope="module")
def client(sglang_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sglang_url, api_key="none", max_retries=0, timeout=600)


# The replies compared here are plain text: with the server's qwen3 reasoning parser, a request that
# leaves thinking on has its reply parsed as reasoning up to a </think> the tiny model does not write.
NO_THINKING = {"type": "disabled"}


def create(client: anthropic.Anthropic, n_turns: int) -> Any:
    return client.beta.messages.create(model="default", max_tokens=5, extra_body={"temperature": 0.0}, tools=TOOLS,
                                       messages=anthropic_messages(n_turns), context_management={"edits": EDITS},
                                       thinking=NO_THINKING)


def test_turns_equal_the_reference_servers_equivalent_program(client: anthropic.Anthropic, sglang_url: str,
                                                              reference_url: str) -> None:
    for n in range(1, N_TURNS + 1):
        preview = client.beta.messages.count_tokens(model="default", tools=TOOLS, messages=anthropic_messages(n),
                                                    context_management={"edits": EDITS})
        planned = dry_run_counters(sglang_url, n)
        assert planned == dry_run_counters(reference_url, n), n
        got = create(client, n)
        status, want = post(reference_url, equivalent(n))
        assert status == 200, want
        text = "".join(b.text for b in got.content if b.type == "text")
        assert text == want["choices"][0]["message"]["content"], n
        usage, details = want["usage"], want["usage"]["prompt_tokens_details"]
        read = got.usage.cache_read_input_tokens or 0  # absent when nothing was read, as stock SGLang
        assert got.usage.input_tokens + read == usage["prompt_tokens"], n
        assert read == details["cached_tokens"] + details["repos_tokens"], n
        assert got.usage.output_tokens == usage["completion_tokens"], n
        assert preview.context_management.original_input_tokens == usage["prompt_tokens"], n
        assert preview.input_tokens == usage["prompt_tokens"] - details["drop_skipped_tokens"], n
        assert planned == {"prompt_tokens": usage["prompt_tokens"], **{key: details[key] for key in AKV_COUNTERS}}, n
        assert planned["cached_tokens"] + planned["repos_tokens"] == read, n
        results = sum(b["type"] == "tool_result" for m in anthropic_messages(n) if isinstance(m["content"], list)
                      for b in m["content"])
        edits = got.context_management.applied_edits if got.context_management else []
        if results > 2:  # the trigger fired: every result but the newest KEEP is cleared
            (edit,) = edits
            assert edit.cleared_tool_uses == results - KEEP
            assert edit.cleared_input_tokens == details["drop_skipped_tokens"] > 0
        else:
            assert edits == []


KEEP_THINKING = 2
THINKING_EDITS = [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": KEEP_THINKING}}]


def thought(i: int) -> str:
    return f"record {i} names record {i + 1}, so that one is next"


def thinking_equivalent(n_turns: int) -> dict[str, Any]:
    """The OpenAI-path request `clear_thinking_20251015` means: each thinking block as the leading
    `<think>` block of its assistant message (as SGLang's conversion wraps it with the qwen3 reasoning
    parser) and, by hand, at the tool result of turn i (message 2i+2) the reasoning of turn
    i - KEEP_THINKING (message 2(i - KEEP_THINKING)+1) dropped."""
    body = equivalent(n_turns)
    body.pop("drop_message", None)
    for i in range(n_turns):
        body["messages"][2 * i + 1]["content"] = f"<think>{thought(i)}\n</think>"
    schedule = {str(2 * i + 2): [2 * (i - KEEP_THINKING) + 1] for i in range(KEEP_THINKING, n_turns)}
    if schedule:
        body["drop_rule"] = {"type": "thinking_drop", "thinking": schedule}
    return {**body, "logprobs": True}


def assert_oracle_reply(model: ReferenceModel, files: ModelDir, body: dict[str, Any], reply: dict[str, Any]) -> int:
    """The reference server's reply to ``body`` token by token against the oracle run of the compiled
    program; returns the number of prompt tokens the program hides from the reply."""
    program = compile_request(files.tokenizer, template_messages(body["messages"]), template=files.chat_template,
                              tools=list(template_tools(body["tools"])), drop_rule=body.get("drop_rule")).program
    entries = reply["choices"][0]["logprobs"]["content"]
    tokens = np.asarray([e["token_id"] for e in entries], dtype=np.int64)
    log_probs = run_program(model, append_generated(program, tokens)).log_probs()
    for j, entry in enumerate(entries):
        row = log_probs[program.n_prompt - 1 + j]
        assert entry["token_id"] == int(torch.argmax(row)), j
        assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=1e-4), j
    assert reply["usage"]["prompt_tokens"] == program.n_prompt
    return int((~program.keep[: program.n_prompt]).sum())


def test_clear_thinking_equals_the_oracle_run_of_its_program(client: anthropic.Anthropic, sglang_url: str,
                                                             reference_url: str, tiny_qwen3: Path) -> None:
    model, files = ReferenceModel.from_pretrained(tiny_qwen3), load_model_dir(tiny_qwen3)
    for n in range(1, N_TURNS + 1):
        messages = anthropic_messages(n, thought)
        edits = {"edits": THINKING_EDITS}
        preview = client.beta.messages.count_tokens(model="default", tools=TOOLS, messages=messages,
                                                    context_management=edits)
        got = client.beta.messages.create(model="default", max_tokens=5, extra_body={"temperature": 0.0},
                                          tools=TOOLS, messages=messages, context_management=edits,
                                          thinking=NO_THINKING)
        body = thinking_equivalent(n)
        status, want = post(reference_url, body)
        assert status == 200, want
        hidden = assert_oracle_reply(model, files, body, want)
        text = "".join(b.text for b in got.content if b.type == "text")
        assert text == want["choices"][0]["message"]["content"], n
        usage, details = want["usage"], want["usage"]["prompt_tokens_details"]
        read = got.usage.cache_read_input_tokens or 0
        assert got.usage.input_tokens + read == usage["prompt_tokens"], n
        assert read == details["cached_tokens"] + details["repos_tokens"], n
        assert got.usage.output_tokens == usage["completion_tokens"], n
        assert preview.context_management.original_input_tokens == usage["prompt_tokens"], n
        assert preview.input_tokens == usage["prompt_tokens"] - hidden, n
        thinking = sum(b["type"] == "thinking" for m in messages if isinstance(m["content"], list)
                       for b in m["content"])
        applied_edits = got.context_management.applied_edits if got.context_management else []
        if thinking > KEEP_THINKING:  # the reasoning of every turn but the newest KEEP_THINKING is cleared
            (edit,) = applied_edits
            assert edit.type == "clear_thinking_20251015"
            assert edit.cleared_thinking_turns == thinking - KEEP_THINKING, n
            assert edit.cleared_input_tokens == hidden == details["drop_skipped_tokens"] > 0, n
        else:
            assert applied_edits == [] and hidden == 0, n


def test_dry_runs_leave_the_cache_as_it_was(sglang_url: str, client: anthropic.Anthropic) -> None:
    create(client, N_TURNS)  # the conversation so far is resident
    body = {**equivalent(N_TURNS + 1), "akv_dry_run": True}
    kv_before = server_info(sglang_url)
    previews = [post_ok(sglang_url, body) for _ in range(2)]
    counted = dry_run_counters(sglang_url, N_TURNS + 1)
    assert server_info(sglang_url) == kv_before
    assert previews[0] == previews[1] and previews[0]["object"] == "akv.dry_run"
    planned = previews[0]["usage"]["prompt_tokens_details"]
    assert {"prompt_tokens": previews[0]["usage"]["prompt_tokens"], **planned} == counted
    assert planned["cached_tokens"] > 0 and planned["computed_tokens"] > 0 and planned["drop_skipped_tokens"] > 0
    served = post_ok(sglang_url, {**body, "akv_dry_run": False})["usage"]
    assert served["prompt_tokens_details"] == planned
    assert served["prompt_tokens"] == previews[0]["usage"]["prompt_tokens"]


def test_dry_run_of_a_plain_request(sglang_url: str) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "plain dry run"}], "max_tokens": 2}
    planned = post_ok(sglang_url, {**body, "akv_dry_run": True})["usage"]
    details = planned["prompt_tokens_details"]
    assert details["cached_tokens"] + details["computed_tokens"] == planned["prompt_tokens"]
    assert details["repos_tokens"] == details["drop_skipped_tokens"] == 0
    served = post_ok(sglang_url, body)["usage"]
    assert served["prompt_tokens"] == planned["prompt_tokens"]
    assert served["prompt_tokens_details"]["cached_tokens"] == details["cached_tokens"]
    again = post_ok(sglang_url, {**body, "akv_dry_run": True})["usage"]["prompt_tokens_details"]
    assert again["cached_tokens"] == planned["prompt_tokens"] - 1  # all resident but the last token


@pytest.mark.parametrize("value", ["yes", 1])
def test_akv_dry_run_must_be_a_boolean(sglang_url: str, value: Any) -> None:
    status, error = post(sglang_url, {**equivalent(2), "akv_dry_run": value})
    assert status == 400 and error["param"] == "akv_dry_run", error
    assert error["message"].startswith("akv_dry_run:"), error


def test_streamed_reply_parses_with_the_sdk(client: anthropic.Anthropic) -> None:
    whole = create(client, N_TURNS)
    with client.beta.messages.stream(model="default", max_tokens=5, extra_body={"temperature": 0.0}, tools=TOOLS,
                                     messages=anthropic_messages(N_TURNS), thinking=NO_THINKING,
                                     context_management={"edits": EDITS}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.context_management.model_dump() == whole.context_management.model_dump()


@pytest.mark.parametrize(("edits", "tools", "field"), [
    ([{"type": "clear_everything_20990101"}], TOOLS, "context_management.edits[0].type"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
       "keep": {"type": "tool_uses", "value": 3}}], TOOLS, "context_management.edits[0].keep.value"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "messages", "value": 2}}], TOOLS,
     "context_management.edits[0].trigger.type"),
    ([{"type": "clear_tool_uses_20250919"}], None, "context_management.edits[0].type"),
])
def test_bad_edits_are_400s_naming_the_field(sglang_url: str, client: anthropic.Anthropic, edits: list[Any],
                                             tools: Any, field: str) -> None:
    messages = anthropic_messages(2) if tools else [{"role": "user", "content": "hello"}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": "default", "messages": messages, "context_management": {"edits": edits}}
        if path == "/v1/messages":
            body["max_tokens"] = 3
        if tools:
            body["tools"] = tools
        status, error = post(sglang_url, body, path=path, timeout=600)
        assert status == 400 and error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(field + ":"), error
    assert create(client, 1).usage.output_tokens > 0, "the server keeps serving"
