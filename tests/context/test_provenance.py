"""Provenance per real chat template: plain render equality, per-message ownership, token owners."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from akv.system.context.compiler import compile_program
from akv.system.context.program import EventKind
from akv.system.context.provenance import ChatTemplate, OwnedText, ProvenanceError, prompt_provenance, token_provenance
from akv.system.context.rules import parse_rules

from .conftest import load_template

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


def _call(call_id: str, city: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


# system, user, assistant (reasoning + two calls), two tool results (one empty), assistant, user.
AGENT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris and 東京?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call tools.",
        "tool_calls": [_call("a", "Paris"), _call("b", "東京")],
    },
    {"role": "tool", "tool_call_id": "a", "content": "22°C sunny"},
    {"role": "tool", "tool_call_id": "b", "content": ""},
    {"role": "assistant", "content": "Paris is 22°C 🦜", "reasoning_content": "both done"},
    {"role": "user", "content": "Thanks!"},
]

# Plain chat without tools, with an empty message and text that byte-level BPE splits inside a character.
CHAT = [
    {"role": "user", "content": "Hi 🦜 there"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "naïve café 北京?"},
]

LOOP = "{% for m in messages %}{{ m.content }}{% endfor %}"

CALLS_2 = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
)
QWEN25_CALLS_2 = (
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
)


def _spans(owned: OwnedText) -> list[str]:
    """Text owned by each message and the reply, read off the character owners."""
    return ["".join(c for c, o in zip(owned.text, owned.char_owners) if o == m) for m in range(owned.n_messages + 1)]


def _hf_render(source: str, messages: list[dict[str, Any]], tools: Any = None, gen: bool = True, **kw: Any) -> str:
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=source, add_generation_prompt=gen, **kw)
    return rendered[0]


@pytest.mark.parametrize("name", ["qwen3.jinja", "qwen2_5.jinja"])
@pytest.mark.parametrize("length", [2, 6, 7])
@pytest.mark.parametrize("gen", [True, False])
def test_plain_and_owned_render_equal_transformers(name: str, length: int, gen: bool) -> None:
    source = load_template(name)
    messages = copy.deepcopy(AGENT[:length])
    template = ChatTemplate(source)
    expected = _hf_render(source, messages, TOOLS, gen)
    assert template.render(messages, tools=TOOLS, add_generation_prompt=gen) == expected
    owned = template.render_owned(messages, tools=TOOLS, add_generation_prompt=gen)
    assert owned.text == expected
    assert owned.char_owners.shape == (len(expected),)
    assert np.all(np.diff(owned.char_owners) >= 0)


def test_qwen3_merges_tool_results_and_drops_earlier_reasoning() -> None:
    owned = ChatTemplate(load_template("qwen3.jinja")).render_owned(AGENT, tools=TOOLS)
    spans = _spans(owned)
    assert spans[0].startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert spans[0].endswith("</tool_call><|im_end|>\n")
    assert spans[1:] == [
        "<|im_start|>user\nWhat's the weather in Paris and 東京?<|im_end|>\n",
        "<|im_start|>assistant\n" + CALLS_2 + "<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n22°C sunny\n</tool_response>",
        "\n<tool_response>\n\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\nParis is 22°C 🦜<|im_end|>\n",
        "<|im_start|>user\nThanks!<|im_end|>\n",
        "<|im_start|>assistant\n",
    ]


def test_qwen3_keeps_reasoning_after_the_last_user_turn() -> None:
    owned = ChatTemplate(load_template("qwen3.jinja")).render_owned(AGENT[:6], tools=TOOLS, enable_thinking=False)
    spans = _spans(owned)
    assert spans[2] == "<|im_start|>assistant\n<think>\nI should call tools.\n</think>\n\n" + CALLS_2 + "<|im_end|>\n"
    assert spans[5] == "<|im_start|>assistant\n<think>\nboth done\n</think>\n\nParis is 22°C 🦜<|im_end|>\n"
    assert spans[6] == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_qwen2_5_tool_calls_and_merged_results() -> None:
    owned = ChatTemplate(load_template("qwen2_5.jinja")).render_owned(AGENT, tools=TOOLS)
    spans = _spans(owned)
    assert spans[0].startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert spans[2] == "<|im_start|>assistant" + QWEN25_CALLS_2 + "<|im_end|>\n"
    assert spans[3] == "<|im_start|>user\n<tool_response>\n22°C sunny\n</tool_response>"
    assert spans[4] == "\n<tool_response>\n\n</tool_response><|im_end|>\n"
    assert spans[5] == "<|im_start|>assistant\nParis is 22°C 🦜<|im_end|>\n"
    assert spans[7] == "<|im_start|>assistant\n"


def test_qwen2_5_default_system_prompt_belongs_to_first_message() -> None:
    owned = ChatTemplate(load_template("qwen2_5.jinja")).render_owned(CHAT)
    spans = _spans(owned)
    assert spans[0] == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi 🦜 there<|im_end|>\n"
    )
    assert spans[1] == "<|im_start|>assistant\n<|im_end|>\n"


def _prefix_oracle(render: Any, messages: list[dict[str, Any]]) -> list[str]:
    """Ownership of a prefix-stable template: what rendering one more message appends."""
    texts = [""] + [render(messages[: k + 1], False) for k in range(len(messages))] + [render(messages, True)]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)
    return [after[len(before) :] for before, after in zip(texts, texts[1:])]


@pytest.mark.parametrize("messages", [CHAT, AGENT[:2] + [{"role": "assistant", "content": "ok"}]])
def test_llama3_matches_prefix_oracle(messages: list[dict[str, Any]]) -> None:
    source = load_template("llama3.jinja")
    template = ChatTemplate(source)
    bos = {"bos_token": "<|begin_of_text|>"}
    owned = template.render_owned(messages, **bos)
    assert owned.text == _hf_render(source, messages, **bos)
    assert _spans(owned) == _prefix_oracle(lambda m, g: template.render(m, add_generation_prompt=g, **bos), messages)
    assert _spans(owned)[0].startswith("<|begin_of_text|><|start_header_id|>")


@pytest.mark.parametrize("messages", [CHAT, AGENT[:2] + [{"role": "assistant", "content": "ok"}]])
def test_qwen2_5_matches_prefix_oracle_without_tool_runs(messages: list[dict[str, Any]]) -> None:
    template = ChatTemplate(load_template("qwen2_5.jinja"))
    owned = template.render_owned(messages)
    assert _spans(owned) == _prefix_oracle(lambda m, g: template.render(m, add_generation_prompt=g), messages)


def test_smollm2_template_from_gguf_matches_transformers_and_prefix_oracle(smollm2: Any) -> None:
    template = ChatTemplate(smollm2.chat_template)
    owned = template.render_owned(CHAT)
    assert owned.text == smollm2.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    spans = _spans(owned)
    assert spans == _prefix_oracle(lambda m, g: template.render(m, add_generation_prompt=g), CHAT)
    assert spans[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def _check_tokens(prov: Any, owned: OwnedText, encode_ids: list[int], decode: Any) -> None:
    assert prov.token_ids.tolist() == encode_ids
    assert np.all(np.diff(prov.owners) >= 0)
    assert prov.boundary_tokens.size == 0
    spans = _spans(owned)
    for m in range(owned.n_messages + 1):
        assert decode(prov.token_ids[prov.owners == m].tolist()) == spans[m]


@pytest.mark.parametrize("name", ["qwen3.jinja", "qwen2_5.jinja"])
def test_token_owners_with_local_bpe_tokenizer(name: str, chatml_tokenizer: Any) -> None:
    owned = ChatTemplate(load_template(name)).render_owned(AGENT, tools=TOOLS)
    prov = token_provenance(owned, chatml_tokenizer)
    ids = chatml_tokenizer.encode(owned.text, add_special_tokens=False).ids
    _check_tokens(prov, owned, ids, lambda t: chatml_tokenizer.decode(t, skip_special_tokens=False))
    # The parrot is cut inside its UTF-8 bytes: several tokens share its one character, same owner.
    parrot = owned.text.index("🦜")
    pieces = np.flatnonzero((prov.offsets[:, 0] <= parrot) & (prov.offsets[:, 1] > parrot))
    assert pieces.size > 1
    assert set(prov.owners[pieces].tolist()) == {5}


def test_token_owners_with_smollm2_tokenizer(smollm2: Any) -> None:
    owned = ChatTemplate(smollm2.chat_template).render_owned(CHAT)
    prov = token_provenance(owned, smollm2)
    ids = smollm2.encode(owned.text, add_special_tokens=False)
    _check_tokens(prov, owned, ids, lambda t: smollm2.decode(t, skip_special_tokens=False))
    parrot = owned.text.index("🦜")
    pieces = np.flatnonzero((prov.offsets[:, 0] <= parrot) & (prov.offsets[:, 1] > parrot))
    assert pieces.size > 1 and set(prov.owners[pieces].tolist()) == {0}


def test_token_spanning_two_messages_goes_to_the_first_and_is_reported(chatml_tokenizer: Any) -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    owned = template.render_owned([{"role": "user", "content": "ab"}, {"role": "user", "content": "cd"}])
    prov = token_provenance(owned, chatml_tokenizer)
    assert chatml_tokenizer.encode("abcd").tokens == ["abcd"]
    assert prov.owners.tolist() == [0]
    assert prov.boundary_tokens.tolist() == [0]


def test_provenance_feeds_the_compiler(chatml_tokenizer: Any) -> None:
    owned = ChatTemplate(load_template("qwen3.jinja")).render_owned(AGENT, tools=TOOLS)
    prov = token_provenance(owned, chatml_tokenizer)
    program = compile_program(prov.token_ids, prov.owners, parse_rules({"6": [3, 4]}, [6], 7), 7)
    drop, repos = program.events
    reply_start = int(np.flatnonzero(prov.owners == 7)[0])
    assert drop.at == repos.at == reply_start and repos.kind is EventKind.REPOS
    ((start, end),) = drop.ranges
    spans = _spans(owned)
    assert chatml_tokenizer.decode(prov.token_ids[start:end].tolist(), skip_special_tokens=False) == spans[3] + spans[4]
    assert program.next_position == len(prov.token_ids) - (end - start)


@pytest.mark.parametrize(
    ("source", "messages", "text"),
    [
        (LOOP + "|" + LOOP, None, "outside any message loop"),
        ("{% for m in messages|reverse %}{{ m.content }}{% endfor %}", None, "message 0 is rendered after message 1"),
        ("{% filter upper %}" + LOOP + "{% endfilter %}", None, "rewrote template output"),
        ("{% set body %}" + LOOP + "{% endset %}{{ body|length }}", None, "rewrote template output"),
        ("{% macro show(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ show(m)|length }}{% endfor %}",
         None, "rewrote template output"),
        ("{% macro wrap() %}{{ caller()|length }}{% endmacro %}{% call wrap() %}" + LOOP + "{% endcall %}", None,
         "rewrote template output"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "same", r"messages\[1\]: same object as messages\[0\]"),
        ("{% for m in messages %}{{ m }}{% endfor %}", "text", r"messages\[0\]: expected an object, got str"),
        (
            "{{ messages[1].content }}{% for m in messages[2:] %}{{ m.content }}{% endfor %}",
            "three",
            r"messages\[1\]: its content is rendered outside a message loop",
        ),
    ],
)
def test_ambiguous_ownership_fails_loudly(source: str, messages: Any, text: str) -> None:
    shared = {"role": "user", "content": "x"}
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    three = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "user", "content": "w"}]
    chosen = {None: two, "same": [shared, shared], "text": ["hi"], "three": three}
    with pytest.raises(ProvenanceError, match=text):
        ChatTemplate(source).render_owned(chosen[messages])


def test_bad_template_and_tokenizer_are_rejected() -> None:
    with pytest.raises(ProvenanceError, match="chat_template: expected a non-empty string"):
        ChatTemplate("")
    owned = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").render_owned([{"content": "a"}])
    with pytest.raises(ProvenanceError, match="tokenizer: object gives no character offsets"):
        token_provenance(owned, object())


def test_prompt_provenance_matches_transformers_render_and_encode(smollm2: Any) -> None:
    prov = prompt_provenance(smollm2, CHAT)
    text = smollm2.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prov.text == text
    assert prov.token_ids.tolist() == smollm2.encode(text, add_special_tokens=False)
    assert prov.owners[-1] == len(CHAT)
    llama = prompt_provenance(smollm2, CHAT, template=load_template("llama3.jinja"), bos_token="<|begin_of_text|>")
    assert llama.text.startswith("<|begin_of_text|><|start_header_id|>user")
    with pytest.raises(ProvenanceError, match="has no chat template"):
        prompt_provenance(object(), CHAT)


def test_generation_prompt_detection_follows_the_test_expression() -> None:
    loop = "{% for m in messages %}{{ m.content }}{% endfor %}"
    one = [{"role": "user", "content": "a"}]
    guarded = ChatTemplate(loop + "{% if add_generation_prompt is defined and add_generation_prompt %}G{% endif %}")
    assert guarded.render_owned(one).char_owners.tolist() == [0, 1]
    is_true = ChatTemplate(loop + "{% if add_generation_prompt is true %}G{% endif %}")
    assert is_true.render_owned(one).char_owners.tolist() == [0, 1]
    negated = ChatTemplate(loop + "{% if not add_generation_prompt %}E{% endif %}")
    with pytest.raises(ProvenanceError, match=r"character 1 \('E'\) is emitted outside any message loop"):
        negated.render_owned(one, add_generation_prompt=False)


class _Clearable:
    """A template variable whose ``clear`` is safe to read (it mutates nothing the sandbox knows)."""

    def clear(self) -> str:
        return "cleared"


# Attribute reads whose sandbox verdict depends on the object's type: a key, a missing key, a dict
# method, a key named like a dict method, a private name, a mutating method of a dict and a list, and
# the same name on an object that is not a known mutable type (read first, so a verdict remembered by
# name alone would leak onto the dict).
SANDBOX_CASES = [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}[{{ m.missing is defined }}{{ m.missing }}]{% endfor %}",
    "{% for m in messages %}{{ m.get('content') }}{{ m.items() | list | length }}{% endfor %}",
    "{% for m in messages %}{{ m['items'] }}|{{ m.items is callable }}{% endfor %}",
    "{% for m in messages %}{{ m.__class__ }}{% endfor %}",
    "{{ thing.clear() }}{% for m in messages %}{{ m.clear is defined }}{% endfor %}",
    "{% for m in messages %}{{ m.clear() }}{% endfor %}",
    "{% for m in messages %}{{ messages.append(m) }}{% endfor %}",
    "{% for m in messages %}{{ m.content.upper() }}{{ m.content.__len__ }}{% endfor %}",
]


@pytest.mark.parametrize("source", SANDBOX_CASES)
def test_sandbox_reads_attributes_like_jinjas_immutable_sandbox(source: str) -> None:
    from collections import OrderedDict

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "user", "content": "a", "items": "key"}, OrderedDict(role="assistant", content="b")]

    def outcome(render: Any) -> tuple[str, str]:
        try:
            return "ok", render()
        except Exception as exc:  # noqa: BLE001 - the reference's error is the expected outcome
            return type(exc).__name__, str(exc)

    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    expected = outcome(lambda: reference.render(messages=messages, thing=_Clearable()))
    template = ChatTemplate(source)
    assert outcome(lambda: template.render(messages, thing=_Clearable())) == expected
    if expected[0] == "ok":
        assert template.render_owned(messages, thing=_Clearable()).text == expected[1]
