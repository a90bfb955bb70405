"""The serving hooks: which context requests are admitted, that plain ones are never checked, and
that context requests are converted off the event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from akv.system.adapter.serving import (
    UnsupportedContextRequest,
    compile_context_program,
    convert_request,
    prepare_context_request,
)
from akv.system.context.drop_rule import RequestRules
from akv.system.context.rules import ContextRules, Drop

MESSAGES = [{"role": "user", "content": str(i)} for i in range(4)]
GOOD_SERVER = {"page_size": 1, "attention_backend": "triton", "prefill_attention_backend": None,
               "decode_attention_backend": None, "radix_cache_backend": "akv", "speculative_algorithm": None,
               "enable_hierarchical_cache": False, "enable_lora": None, "enable_mixed_chunk": False,
               "enable_dp_attention": False, "disable_radix_cache": False, "pp_size": 1,
               "disaggregation_mode": "null", "disaggregation_decode_enable_radix_cache": False,
               "optimistic_prefill_attempts": 0}


def _serving(chat_template_name: str | None = None, **server: object) -> SimpleNamespace:
    return SimpleNamespace(
        chat_encoding_spec=None,
        template_manager=SimpleNamespace(chat_template_name=chat_template_name),
        tokenizer_manager=SimpleNamespace(server_args=SimpleNamespace(**{**GOOD_SERVER, **server})),
    )


def _request(**fields: object) -> SimpleNamespace:
    base = {"messages": MESSAGES, "drop_message": None, "reposition": None, "n": 1, "input_ids": None,
            "continue_final_message": False, "akv_unknown_fields": None}
    return SimpleNamespace(**{**base, **fields})


def test_context_request_yields_its_rules() -> None:
    rules = prepare_context_request(_serving(), _request(drop_message={"2": [0, 1]}, reposition=[2, 3]), False)
    assert rules == RequestRules(ContextRules(drops=(Drop(anchor=2, messages=(0, 1)),), repositions=(2, 3)))


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
def test_context_requests_are_served_on_every_backend_that_executes_them(backend: str) -> None:
    for server in ({"attention_backend": backend}, {"attention_backend": "triton", "decode_attention_backend": backend}):
        assert prepare_context_request(_serving(**server), _request(reposition=[1]), False) is not None


@pytest.mark.parametrize("drop_message", [None, {}])
def test_plain_request_is_not_checked_even_on_an_unsupported_setup(drop_message: object) -> None:
    serving = _serving("chatml", page_size=16, attention_backend="fa4")
    request = _request(drop_message=drop_message, n=3, input_ids=[1, 2], continue_final_message=True)
    assert prepare_context_request(serving, request, True) is None


@pytest.mark.parametrize(
    ("request_fields", "multimodal", "message"),
    [
        ({"n": 2}, False, "n: drop_message/reposition need n == 1, got 2"),
        ({"input_ids": [5, 6]}, False, "input_ids: "),
        ({"continue_final_message": True}, False, "continue_final_message: "),
        ({}, True, "model: drop_message/reposition are not supported for multimodal models"),
    ],
)
def test_unsupported_request_modes_are_refused(request_fields: dict, multimodal: bool, message: str) -> None:
    with pytest.raises(UnsupportedContextRequest, match=message):
        prepare_context_request(_serving(), _request(reposition=[1], **request_fields), multimodal)


@pytest.mark.parametrize(
    ("template", "server", "message"),
    [
        ("chatml", {}, "chat_template: the built-in template 'chatml'"),
        (None, {"page_size": 16}, "server configuration: page_size 16"),
        (None, {"attention_backend": "torch_native"}, "server configuration: attention_backend 'torch_native'"),
        (None, {"decode_attention_backend": "fa4"}, "server configuration: decode_attention_backend 'fa4'"),
        (None, {"prefill_attention_backend": "trtllm_mha"}, "server configuration: prefill_attention_backend 'trtllm_mha'"),
        (None, {"radix_cache_backend": None}, "server configuration: radix_cache_backend None cannot execute"),
        (None, {"speculative_algorithm": "EAGLE"}, r"server configuration: speculative_algorithm \(speculative"),
        (None, {"enable_lora": True}, r"server configuration: enable_lora \(LoRA\)"),
        (None, {"enable_hierarchical_cache": True}, r"server configuration: enable_hierarchical_cache"),
        (None, {"enable_mixed_chunk": True}, r"server configuration: enable_mixed_chunk"),
        (None, {"enable_dp_attention": True}, r"server configuration: enable_dp_attention"),
        (None, {"pp_size": 2}, r"server configuration: pp_size 2"),
        (None, {"disaggregation_mode": "prefill", "optimistic_prefill_attempts": 2},
         r"server configuration: optimistic_prefill_attempts \(optimistic prefill"),
        (None, {"disaggregation_mode": "decode", "radix_cache_backend": None, "disable_radix_cache": True,
                "disaggregation_decode_enable_radix_cache": True},
         r"server configuration: disaggregation_decode_enable_radix_cache \(a decode-side radix cache\)"),
        (None, {"disaggregation_mode": "prefill", "radix_cache_backend": None},
         "server configuration: radix_cache_backend None cannot execute"),
    ],
)
def test_unsupported_server_setups_are_refused(template: str | None, server: dict, message: str) -> None:
    with pytest.raises(UnsupportedContextRequest, match=message):
        prepare_context_request(_serving(template, **server), _request(drop_message={"1": [0]}), False)


@pytest.mark.parametrize("server", [
    {"disaggregation_mode": "prefill"},
    # a decode server as launch_server starts it: SGLang's chunk cache, no AKV radix cache
    {"disaggregation_mode": "decode", "radix_cache_backend": None, "disable_radix_cache": True},
])
def test_both_servers_of_a_pd_pair_accept_context_requests(server: dict) -> None:
    prepared = prepare_context_request(_serving(None, **server), _request(drop_message={"1": [0]}), False)
    assert prepared is not None


def test_refusals_are_value_errors_so_sglang_answers_400() -> None:
    assert issubclass(UnsupportedContextRequest, ValueError)


def test_custom_encoder_is_refused() -> None:
    serving = _serving()
    serving.chat_encoding_spec = "dsv4"
    with pytest.raises(UnsupportedContextRequest, match="chat_template: the custom encoder 'dsv4'"):
        prepare_context_request(serving, _request(reposition=[1]), False)


# ----------------------------------------------------------------- program compilation ---

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                          "parameters": {"type": "object",
                                                         "properties": {"word": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does cache mean?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"word": "cache"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a store of things kept for later use"},
    {"role": "user", "content": "And prefix?"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from akv.system.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), vocab_size=1024, weights=False)
    return AutoTokenizer.from_pretrained(str(folder))


def _server_prompt_ids(tokenizer) -> list[int]:
    """What SGLang's jinja path produces: render to text, then encode once."""
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_program_is_compiled_from_the_servers_prompt(tokenizer) -> None:
    prompt_ids = _server_prompt_ids(tokenizer)
    request = _request(messages=CONVERSATION, drop_message={"3": [3]}, reposition=[3])
    program = compile_context_program(request, tokenizer, CONVERSATION, TOOLS, {}, prompt_ids)
    assert program.token_ids.tolist() == prompt_ids and program.n_prompt == len(prompt_ids)
    assert [e.kind.name for e in program.events] == ["DROP", "REPOS"]
    hidden = [t for t in range(program.n_prompt) if not program.keep[t]]
    assert hidden and hidden == list(range(hidden[0], hidden[-1] + 1))
    assert "a store of things kept for later use" in tokenizer.decode([prompt_ids[t] for t in hidden])
    after = tokenizer.decode(prompt_ids[hidden[-1] + 1:])
    assert "And prefix?" in after and "a store of things" not in after
    assert program.next_position == int(program.keep.sum())


def test_plain_request_compiles_nothing() -> None:
    assert compile_context_program(_request(), None, MESSAGES, None, {}, [1, 2, 3]) is None


def test_prompt_that_provenance_cannot_reproduce_is_refused(tokenizer) -> None:
    prompt_ids = _server_prompt_ids(tokenizer)
    tampered = prompt_ids[:5] + [prompt_ids[5] + 1] + prompt_ids[6:]
    request = _request(messages=CONVERSATION, reposition=[2])
    with pytest.raises(UnsupportedContextRequest, match="chat_template: .* differs from the server's prompt at token 5"):
        compile_context_program(request, tokenizer, CONVERSATION, TOOLS, {}, tampered)


def test_template_variable_named_like_a_render_argument_is_refused(tokenizer) -> None:
    prompt_ids = _server_prompt_ids(tokenizer)
    request = _request(messages=CONVERSATION, reposition=[2])
    with pytest.raises(UnsupportedContextRequest, match=r"chat_template_kwargs\['prompt_ids'\]: collides"):
        compile_context_program(request, tokenizer, CONVERSATION, TOOLS, {"prompt_ids": [1]}, prompt_ids)


# ---------------------------------------------------------------------------- drop_rule ---

QWEN3 = (Path(__file__).parents[1] / "context" / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
REASONED = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up first."},
    {"role": "user", "content": "Tomorrow?"},
]


def _sglang_render(tokenizer, request) -> list[int]:
    """SGLang's jinja path: chat_template_kwargs spread into apply_chat_template, then one encode."""
    text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True,
                                         **(request.chat_template_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=False)


def test_thinking_drop_has_sglang_render_the_reasoning_it_drops(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", QWEN3)
    serving = _serving()
    serving.tokenizer_manager.tokenizer = tokenizer
    request = _request(messages=REASONED, drop_rule={"type": "thinking_drop"}, chat_template_kwargs=None)
    prepare_context_request(serving, request, False)
    prompt_ids = _sglang_render(tokenizer, request)
    assert "Look it up first." in tokenizer.decode(prompt_ids)  # stock Qwen3 would leave it out
    program = compile_context_program(request, tokenizer, REASONED, None, dict(request.chat_template_kwargs),
                                      prompt_ids)
    hidden = tokenizer.decode([prompt_ids[t] for t in range(program.n_prompt) if not program.keep[t]])
    assert hidden == "<think>\nLook it up first.\n</think>\n\n"
    assert [e.anchor for e in program.events] == [1]


def test_keep_text_drop_swaps_in_the_full_messages() -> None:
    full = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "long answer"},
            {"role": "user", "content": "next"}]
    request = _request(messages=[full[0], full[2]], drop_rule={"type": "keep_text_drop", "full_messages": full})
    rules = prepare_context_request(_serving(), request, False)
    assert request.messages == full and rules.span.kept == ((0, 4), None, (0, 4))
    forced = _request(messages=[{"role": "user", "content": "other"}],
                      drop_rule={"type": "keep_text_drop", "full_messages": full, "force": True})
    assert prepare_context_request(_serving(), forced, False).span is None
    assert forced.messages == [{"role": "user", "content": "other"}]


def test_thinking_drop_refuses_a_client_template() -> None:
    request = _request(messages=REASONED, drop_rule={"type": "thinking_drop"},
                       chat_template_kwargs={"chat_template": "{{ x }}"})
    serving = _serving()
    serving.tokenizer_manager.tokenizer = SimpleNamespace(chat_template=QWEN3)
    with pytest.raises(UnsupportedContextRequest, match=r"chat_template_kwargs\['chat_template'\]: not supported"):
        prepare_context_request(serving, request, False)


def test_unplaceable_text_is_a_400_on_drop_rule(tokenizer) -> None:
    from akv.system.adapter.serving import error_param
    from akv.system.context.spans import SpanError

    messages = [{"role": "user", "content": "Hello there"}, {"role": "user", "content": "Next"}]
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": "there"}, None]}
    request = _request(messages=messages, drop_rule=rule)
    prepare_context_request(_serving(), request, False)
    normalised = [{"role": "user", "content": "Hello there!"}, messages[1]]  # what a normaliser might change
    text = tokenizer.apply_chat_template(normalised, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(SpanError) as info:
        compile_context_program(request, tokenizer, normalised, None, {}, prompt_ids)
    assert error_param(info.value) == "drop_rule"


class _BlockingServing:
    """A serving object whose conversion records its thread and, for ``gate``, waits until released."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.threads: list[int] = []

    def _convert_to_internal_request(self, request: object, raw_request: object) -> tuple[object, object]:
        self.threads.append(threading.get_ident())
        if self.gate is not None and not self.gate.wait(timeout=30):
            raise TimeoutError("gate: never opened")
        if getattr(request, "bad", False):
            raise ValueError("messages: bad")
        return ("adapted", request)


def test_plain_requests_convert_inline() -> None:
    serving = _BlockingServing()
    out = asyncio.run(convert_request(serving, _request(), None))
    assert out[0] == "adapted" and serving.threads == [threading.get_ident()]


def test_context_requests_convert_off_the_event_loop() -> None:
    """While a context request's conversion is stuck, the event loop still runs other work (a plain
    request's conversion); the context request completes once released."""
    gate = threading.Event()
    serving = _BlockingServing(gate)

    async def scenario() -> tuple[object, object]:
        long = asyncio.ensure_future(convert_request(serving, _request(drop_message={"2": [0]}), None))
        while not serving.threads:
            await asyncio.sleep(0.001)
        plain = await convert_request(_BlockingServing(), _request(), None)
        assert not long.done(), "the context conversion finished although it is still held"
        gate.set()
        return plain, await long

    plain, long = asyncio.run(scenario())
    assert plain[0] == "adapted" and long[0] == "adapted"
    assert serving.threads[0] != threading.get_ident()


def test_errors_of_an_off_loop_conversion_reach_the_handler() -> None:
    with pytest.raises(ValueError, match="messages: bad"):
        asyncio.run(convert_request(_BlockingServing(), _request(reposition=[1], bad=True), None))
