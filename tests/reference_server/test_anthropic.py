"""The Anthropic Messages API on the reference server, driven by the official `anthropic` SDK: a
multi-turn tool-use conversation with `clear_tool_uses_20250919` and `clear_thinking_20251015` is
served as the equivalent OpenAI-path drop program (written by hand here, checked against the oracle),
`applied_edits` equal a count from the message list, streaming parses with the SDK, `count_tokens`
(a dry run) equals the usage of the request that follows and leaves the cache as it was, and bad
edits are 400s naming the field."""

from __future__ import annotations

import shutil
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
from akv.system.reference_server import Engine, ReferenceServer

from anthropic_conversation import OPENAI_TOOLS, TOOLS, anthropic_messages, openai_messages
from http_client import post
from .conftest import MODEL_NAME

QWEN3_TEMPLATE = Path(__file__).parents[1] / "context" / "templates" / "qwen3.jinja"
N_TURNS = 4
KEEP_TOOL_USES = 1
TRIGGER_TOOL_USES = 2
EDITS = [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
         {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": TRIGGER_TOOL_USES},
          "keep": {"type": "tool_uses", "value": KEEP_TOOL_USES}}]
# The same conversation as OpenAI messages (0: user; turn i: assistant 2i+1, tool 2i+2) and the drop
# program the edits mean, by hand: tool results older than the newest one are dropped at each batch
# after the second (more than 2 tool uses), reasoning older than the last turn at each later batch.
EQUIVALENT = {"drop_rule": {"type": "thinking_drop", "thinking": {"4": [1], "6": [3], "8": [5]},
                            "drop_messages": {"6": [2, 4], "8": [6]}}}


def thought(i: int) -> str:
    return f"record {i} names the next one"


@pytest.fixture(scope="module")
def qwen3_served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    model_dir = tmp_path_factory.mktemp("qwen3-template") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(QWEN3_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    engine = Engine(model_dir, name=MODEL_NAME, kv_slots=4096)
    server = ReferenceServer(engine)
    with server.running():
        yield server.url, engine


@pytest.fixture(scope="module")
def client(qwen3_served: tuple[str, Engine]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen3_served[0], api_key="none", max_retries=0)


def cache_state(engine: Engine) -> tuple[Any, ...]:
    tree = engine.cache.tree
    return engine.pool.n_free, tree.epoch, tree.n_nodes, tree.stats(), tree.resident_slots().tolist()


def create(client: anthropic.Anthropic, n_turns: int, **kwargs: Any) -> Any:
    return client.beta.messages.create(model=MODEL_NAME, max_tokens=5, messages=anthropic_messages(n_turns, thought),
                                       tools=TOOLS, context_management={"edits": EDITS}, **kwargs)


def test_edits_are_served_as_the_equivalent_openai_program(qwen3_served: tuple[str, Engine],
                                                           client: anthropic.Anthropic) -> None:
    url, engine = qwen3_served
    engine.cache.flush()
    for n in range(1, N_TURNS):  # the earlier turns of the conversation, each with the same edits
        create(client, n)
    before = cache_state(engine)
    preview = client.beta.messages.count_tokens(model=MODEL_NAME, messages=anthropic_messages(N_TURNS, thought),
                                                tools=TOOLS, context_management={"edits": EDITS})
    assert cache_state(engine) == before, "a dry run changed the pool or the tree"
    reply = create(client, N_TURNS)

    # applied_edits against a count from the message list: every tool result but the newest KEEP, and
    # the reasoning of every assistant turn but the last (the trigger fires at the last batch)
    messages = anthropic_messages(N_TURNS, thought)
    blocks = [b for m in messages if isinstance(m["content"], list) for b in m["content"]]
    results = sum(b["type"] == "tool_result" for b in blocks)
    thinking = sum(b["type"] == "thinking" for b in blocks)
    edits = {e.type: e for e in reply.context_management.applied_edits}
    assert edits["clear_tool_uses_20250919"].cleared_tool_uses == results - KEEP_TOOL_USES
    assert edits["clear_thinking_20251015"].cleared_thinking_turns == thinking - 1
    cleared = sum(e.cleared_input_tokens for e in edits.values())
    assert all(e.cleared_input_tokens > 0 for e in edits.values())

    # the same program through the OpenAI path, checked against the oracle token by token
    status, plain = post(url, {"model": MODEL_NAME, "messages": openai_messages(N_TURNS, thought),
                               "tools": OPENAI_TOOLS, "max_tokens": 5, "logprobs": True, **EQUIVALENT})
    assert status == 200, plain
    compiled = compile_request(engine.files.tokenizer, template_messages(openai_messages(N_TURNS, thought)),
                               template=engine.files.chat_template, tools=list(template_tools(OPENAI_TOOLS)),
                               **EQUIVALENT)
    program = compiled.program
    tokens = [e["token_id"] for e in plain["choices"][0]["logprobs"]["content"]]
    log_probs = run_program(ReferenceModel.from_pretrained(engine.files.path),
                            append_generated(program, np.asarray(tokens, dtype=np.int64))).log_probs()
    for j, entry in enumerate(plain["choices"][0]["logprobs"]["content"]):
        row = log_probs[program.n_prompt - 1 + j]
        assert entry["token_id"] == int(torch.argmax(row)), j
        assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=1e-4), j
    text = "".join(b.text for b in reply.content if b.type == "text")
    assert text == (plain["choices"][0]["message"]["content"] or "")
    assert reply.usage.output_tokens == len(tokens)
    assert cleared == int((~program.keep[: program.n_prompt]).sum())

    # the dry run's numbers are the usage of the request that followed it
    akv = reply.usage.model_extra["akv"]
    assert preview.context_management.original_input_tokens == akv["prompt_tokens"] == program.n_prompt
    assert preview.input_tokens == program.n_prompt - cleared
    assert preview.model_extra["akv"] == akv
    assert reply.usage.cache_read_input_tokens == akv["cached_tokens"] + akv["repos_tokens"] > 0
    assert reply.usage.input_tokens == program.n_prompt - reply.usage.cache_read_input_tokens


def test_streamed_reply_parses_with_the_sdk(qwen3_served: tuple[str, Engine], client: anthropic.Anthropic) -> None:
    whole = create(client, N_TURNS)
    with client.beta.messages.stream(model=MODEL_NAME, max_tokens=5, messages=anthropic_messages(N_TURNS, thought),
                                     tools=TOOLS, context_management={"edits": EDITS}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.context_management.model_dump() == whole.context_management.model_dump()
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens


def test_chat_completions_dry_run_equals_the_request_that_follows(qwen3_served: tuple[str, Engine]) -> None:
    url, engine = qwen3_served
    body = {"model": MODEL_NAME, "messages": openai_messages(2, thought), "tools": OPENAI_TOOLS, "max_tokens": 3,
            "drop_message": {"4": [2]}, "reposition": [4]}
    before = cache_state(engine)
    status, dry = post(url, {**body, "akv_dry_run": True})
    assert status == 200 and cache_state(engine) == before
    status, real = post(url, body)
    assert status == 200
    assert dry["usage"]["prompt_tokens"] == real["usage"]["prompt_tokens"]
    assert dry["usage"]["prompt_tokens_details"] == real["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize(("edits", "tools", "field"), [
    ([{"type": "clear_everything_20990101"}], TOOLS, "context_management.edits[0].type"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
       "keep": {"type": "tool_uses", "value": 3}}], TOOLS, "context_management.edits[0].keep.value"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "messages", "value": 2}}], TOOLS,
     "context_management.edits[0].trigger.type"),
    ([{"type": "clear_tool_uses_20250919"}], None, "context_management.edits[0].type"),
])
def test_bad_edits_are_400s_naming_the_field(qwen3_served: tuple[str, Engine], edits: list[Any], tools: Any,
                                             field: str) -> None:
    url, engine = qwen3_served
    messages = anthropic_messages(2, thought) if tools else [{"role": "user", "content": "hello"}]
    before = cache_state(engine)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": MODEL_NAME, "messages": messages, "context_management": {"edits": edits}}
        if path == "/v1/messages":
            body["max_tokens"] = 3
        if tools:
            body["tools"] = tools
        status, error = post(url, body, path=path)
        assert status == 400 and error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(field + ":"), error
        assert "Traceback" not in error["error"]["message"]
    assert cache_state(engine) == before
