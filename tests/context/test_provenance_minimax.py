"""Provenance on the official MiniMax-M2 chat template (fetched from the llama-cpp-python sdist), with a
stand-in BPE tokenizer whose added tokens are the template's markers."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from akv.system.context.compiler import compile_program
from akv.system.context.provenance import ChatTemplate, OwnedText, ProvenanceError, token_provenance
from akv.system.context.rules import parse_rules
from akv.system.models.minimax_m2 import ADDED_TOKENS, TEMPLATE_NAME
from akv.system.models.sdist_templates import TemplateFetchError, official_template
from akv.system.models.tiny import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_BLOCK = (
    "\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n\n<tools>\n"
    '<tool>{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}</tool>\n</tools>\n\n'
    "When making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n"
    '<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n'
    '<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n</minimax:tool_call>'
)


def _call(city: str) -> dict[str, Any]:
    return {"id": city, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def _invoke(city: str) -> str:
    return f'<invoke name="get_weather">\n<parameter name="city">{city}</parameter>\n</invoke>\n'


SYSTEM = {"role": "system", "content": "You are terse."}
# user, assistant (reasoning + two calls), two tool results, assistant (inline <think>), user.
TURNS = [
    {"role": "user", "content": "Weather in Paris and 東京?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call both.",
     "tool_calls": [_call("Paris"), _call("東京")]},
    {"role": "tool", "tool_call_id": "Paris", "content": "22°C"},
    {"role": "tool", "tool_call_id": "東京", "content": "18°C 🦜"},
    {"role": "assistant", "content": "<think>\nSum up.\n</think>\n\nParis 22°C, 東京 18°C."},
    {"role": "user", "content": "Thanks!"},
]
CALLS = "\n<minimax:tool_call>\n" + _invoke("Paris") + _invoke("東京") + "</minimax:tool_call>"


@pytest.fixture(scope="module")
def template_source() -> str:
    try:
        return official_template(TEMPLATE_NAME)
    except TemplateFetchError as exc:
        pytest.skip(f"official MiniMax-M2 template unavailable: {exc}")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(800, ADDED_TOKENS)


def _spans(owned: OwnedText) -> list[str]:
    return ["".join(c for c, o in zip(owned.text, owned.char_owners) if o == m) for m in range(owned.n_messages + 1)]


def _hf_render(source: str, messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=source, add_generation_prompt=gen)
    return rendered[0]


CASES = {
    "system+tools": ([SYSTEM] + TURNS, TOOLS),
    "system": ([SYSTEM] + TURNS, None),
    "tools": (TURNS, TOOLS),
    "plain": (TURNS, None),
    "system only": ([SYSTEM], TOOLS),
    "tool loop": ([SYSTEM] + TURNS[:4], TOOLS),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gen", [True, False])
def test_ids_and_owners_equal_the_template_render(template_source: str, tokenizer: Any, case: str, gen: bool) -> None:
    messages, tools = copy.deepcopy(CASES[case])
    expected = _hf_render(template_source, messages, tools, gen)
    owned = ChatTemplate(template_source).render_owned(messages, tools=tools, add_generation_prompt=gen)
    assert owned.text == expected
    prov = token_provenance(owned, tokenizer)
    assert prov.token_ids.tolist() == tokenizer.encode(expected, add_special_tokens=False).ids
    assert np.all(np.diff(prov.owners) >= 0)
    assert prov.boundary_tokens.size == 0
    spans = _spans(owned)
    assert all(spans[: len(messages)]), "every message owns text"
    for m in range(owned.n_messages + 1):
        assert tokenizer.decode(prov.token_ids[prov.owners == m].tolist(), skip_special_tokens=False) == spans[m]


def test_out_of_loop_system_message_owns_its_closing_marker_and_the_tool_list(template_source: str) -> None:
    owned = ChatTemplate(template_source).render_owned([SYSTEM] + TURNS, tools=TOOLS)
    assert _spans(owned) == [
        "]~!b[]~b]system\nYou are terse." + TOOLS_BLOCK + "[e~[\n",
        "]~b]user\nWeather in Paris and 東京?[e~[\n",
        "]~b]ai\n" + CALLS + "[e~[\n",
        "]~b]tool\n<response>22°C</response>",
        "\n<response>18°C 🦜</response>[e~[\n",
        "]~b]ai\nParis 22°C, 東京 18°C.[e~[\n",
        "]~b]user\nThanks![e~[\n",
        "]~b]ai\n<think>\n",
    ]


def test_without_system_message_the_default_system_block_goes_to_message_0(template_source: str) -> None:
    spans = _spans(ChatTemplate(template_source).render_owned(TURNS[:1], tools=TOOLS))
    assert spans == [
        "]~!b[]~b]system\nYou are a helpful assistant." + TOOLS_BLOCK
        + "[e~[\n]~b]user\nWeather in Paris and 東京?[e~[\n",
        "]~b]ai\n<think>\n",
    ]


def test_interleaved_thinking_is_kept_only_after_the_last_user_message(template_source: str) -> None:
    template = ChatTemplate(template_source)
    in_loop = _spans(template.render_owned([SYSTEM] + TURNS[:5], tools=TOOLS))
    assert in_loop[2] == "]~b]ai\n<think>\nCall both.\n</think>\n\n" + CALLS + "[e~[\n"
    assert in_loop[5] == "]~b]ai\n<think>\nSum up.\n</think>\n\nParis 22°C, 東京 18°C.[e~[\n"
    after_user = _spans(template.render_owned([SYSTEM] + TURNS, tools=TOOLS))
    assert after_user[2] == "]~b]ai\n" + CALLS + "[e~[\n"
    assert after_user[5] == "]~b]ai\nParis 22°C, 東京 18°C.[e~[\n"


def _prefix_oracle(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any) -> list[str]:
    """What rendering one more message appends (valid for prefix-stable conversations)."""
    texts = [""] + [template.render(messages[: k + 1], tools=tools, add_generation_prompt=False)
                    for k in range(len(messages))] + [template.render(messages, tools=tools)]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)
    return [after[len(before):] for before, after in zip(texts, texts[1:])]


@pytest.mark.parametrize("system", [True, False])
def test_single_tool_results_without_reasoning_match_the_prefix_oracle(template_source: str, system: bool) -> None:
    turns = [
        TURNS[0],
        {"role": "assistant", "content": "Checking.", "tool_calls": [_call("Paris")]},
        {"role": "tool", "tool_call_id": "Paris", "content": "22°C"},
        {"role": "assistant", "content": "22°C."},
        {"role": "user", "content": "And 東京?"},
    ]
    messages = [SYSTEM] + turns if system else turns
    template = ChatTemplate(template_source)
    owned = template.render_owned(messages, tools=TOOLS)
    assert _spans(owned) == _prefix_oracle(template, messages, TOOLS)


def test_dropping_the_first_tool_result_drops_the_shared_header(template_source: str, tokenizer: Any) -> None:
    messages = [SYSTEM] + TURNS
    owned = ChatTemplate(template_source).render_owned(messages, tools=TOOLS)
    prov = token_provenance(owned, tokenizer)
    program = compile_program(prov.token_ids, prov.owners, parse_rules({"6": [3]}, None, len(messages)), len(messages))
    ((start, end),) = program.events[0].ranges
    dropped = tokenizer.decode(prov.token_ids[start:end].tolist(), skip_special_tokens=False)
    assert dropped == "]~b]tool\n<response>22°C</response>"


def test_first_message_through_a_macro_argument_owns_the_text_up_to_the_loop() -> None:
    source = (
        "{% macro head(m) %}<{{ m.content }}>{% endmacro %}"
        "{{ head(messages[0]) }}|tools|{% for m in messages[1:] %}[{{ m.content }}]{% endfor %}"
    )
    owned = ChatTemplate(source).render_owned([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert _spans(owned) == ["<s>|tools|", "[u]", ""]


@pytest.mark.parametrize(
    "source",
    [
        # message 0 rendered by the loop itself: a gap after it stays a guess
        "{% for m in messages[:1] %}{{ m.content }}{% endfor %}|{% for m in messages[1:] %}{{ m.content }}{% endfor %}",
        # text after the loop, following a later message
        "{% macro head(m) %}{{ m.content }}{% endmacro %}{{ head(messages[0]) }}"
        "{% for m in messages[1:] %}{{ m.content }}{% endfor %}|",
    ],
)
def test_unowned_text_elsewhere_still_fails(source: str) -> None:
    with pytest.raises(ProvenanceError, match="outside any message loop"):
        ChatTemplate(source).render_owned([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])


def test_text_owned_by_no_message_stays_plain_for_template_string_operations() -> None:
    # The MiniMax template splits a macro's output at '</think>'; ownership markers in it would be cut.
    source = (
        "{% macro visible(c) %}{{ c }}{% endmacro %}"
        "{% for m in messages %}{% set x = visible(m.content) %}{{ x.split('|')[-1] if x else '-' }}{% endfor %}"
    )
    owned = ChatTemplate(source).render_owned([{"role": "user", "content": "a|b"}, {"role": "user", "content": ""}])
    assert _spans(owned) == ["b", "-", ""]
