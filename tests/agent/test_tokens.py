"""ChatTemplateTokenCounter on locally built tokenizers: hand-worked ownership, agreement with the
server-side provenance, and use inside token rules."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from akv.agent import CachePolicy, ConfigError, TokenSelection, TokenTrigger  # noqa: E402
from akv.agent.templating import sglang_template_inputs, template_messages  # noqa: E402
from akv.agent.tokens import ChatTemplateTokenCounter  # noqa: E402

from .chatml import build_tokenizer  # noqa: E402
from .conversations import TOOLS, call, random_conversation, result  # noqa: E402

CHAR_TEMPLATE = ("{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


@pytest.fixture(scope="module")
def chatml():
    tokenizer = build_tokenizer()
    return tokenizer, ChatTemplateTokenCounter(tokenizer)


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(set("<>abcdefghijklmnopqrstuvwxyz "))
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(alphabet + ["[UNK]"])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = CHAR_TEMPLATE
    return fast


def test_character_tokenizer_worked_example():
    # DESIGN/§2.1 example: "<user>old" is 9 characters, "<assistant>answer" 17, "<user>new" 9; the
    # generation prompt "<assistant>" (11) belongs to the reply.
    counter = ChatTemplateTokenCounter(char_tokenizer())
    messages = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "answer"},
                {"role": "user", "content": "new"}]
    layout = counter.layout(messages)
    assert layout.spans == ((0, 9), (9, 26), (26, 35))
    assert layout.generation_tokens == 11
    assert layout.prompt_tokens == 46


def owned_text(tokenizer, rendered, owner):
    return tokenizer.decode([t for t, o in zip(rendered.token_ids, rendered.owners) if o == owner])


def test_chatml_ownership_follows_the_message_each_piece_frames(chatml):
    tokenizer, counter = chatml
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "go"},
                call(["A", "B"]), result("A", "A is 1"), result("B", "B is 2"), call("C"), result("C", "C")]
    rendered = counter.render(messages, tools=TOOLS[:1])
    # SGLang renders each tool's pydantic model_dump(): description first, strict and defer_loading added
    served_tool = {"type": "function", "function": {"description": "read_record tool", "name": "read_record",
                                                    "parameters": {"type": "object", "properties": {}},
                                                    "strict": False}, "defer_loading": None}
    tool_json = ('{"type": "function", "function": {"description": "read_record tool", "name": "read_record", '
                 '"parameters": {"type": "object", "properties": {}}, "strict": false}, "defer_loading": null}')
    expected = [
        f"<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>\n{tool_json}\n</tools><|im_end|>\n",
        "<|im_start|>user\ngo<|im_end|>\n",
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "read_record", "arguments": {"id": "A"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "read_record", "arguments": {"id": "B"}}\n</tool_call><|im_end|>\n',
        "<|im_start|>user\n<tool_response>\nA is 1\n</tool_response>",
        "\n<tool_response>\nB is 2\n</tool_response><|im_end|>\n",
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "read_record", "arguments": {"id": "C"}}\n</tool_call>'
        "<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\nC\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n",
    ]
    assert [owned_text(tokenizer, rendered, i) for i in range(len(messages) + 1)] == expected
    assert rendered.text == "".join(expected)
    assert rendered.text == tokenizer.apply_chat_template(template_messages(messages), tools=[served_tool],
                                                          tokenize=False, add_generation_prompt=True)
    assert list(rendered.token_ids) == tokenizer.encode(rendered.text, add_special_tokens=False)
    spans = rendered.layout.spans
    assert [end - start for start, end in spans] == [rendered.owners.count(i) for i in range(len(messages))]
    assert rendered.layout.generation_tokens == rendered.owners.count(len(messages))


def test_generation_prompt_includes_the_thinking_switch(chatml):
    tokenizer, counter = chatml
    messages = [{"role": "user", "content": "go"}]
    rendered = counter.render(messages, chat_template_kwargs={"enable_thinking": False})
    assert owned_text(tokenizer, rendered, 1) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_system_message_without_tools_and_a_leading_user_message(chatml):
    tokenizer, counter = chatml
    rendered = counter.render([{"role": "user", "content": "go"}, call("A"), result("A", "done")], tools=TOOLS[:1])
    # no system message: the tools block precedes message 0's own output and belongs to it
    assert owned_text(tokenizer, rendered, 0).startswith("<|im_start|>system\n# Tools")
    assert owned_text(tokenizer, rendered, 0).endswith("<|im_start|>user\ngo<|im_end|>\n")


def test_token_rules_with_the_template_counter(chatml):
    _, counter = chatml
    messages = [{"role": "user", "content": "go"}]
    for i in range(5):
        messages += [call(str(i)), result(str(i), "the record A holds the value forty two " * 3)]
    layout = counter.layout(messages, tools=TOOLS)
    sizes = [end - start for start, end in layout.spans]
    threshold = sum(sizes[:9]) + layout.generation_tokens  # fits through boundary 8, not boundary 10
    at_10 = sum(sizes[:11]) + layout.generation_tokens
    target = at_10 - sizes[2] - sizes[4] // 2  # reached by dropping the two oldest results, not one
    policy = CachePolicy(trigger=TokenTrigger(threshold, counter), selector=TokenSelection(target, counter))
    new, _ = policy.process({"model": "m", "messages": messages[:11], "tools": TOOLS})
    assert new["drop_message"] == {"10": [2, 4]}


def test_constructor_errors():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        ChatTemplateTokenCounter(tokenizer)
    slow = SimpleNamespace(chat_template=CHAR_TEMPLATE, is_fast=False)
    with pytest.raises(ConfigError, match="needs a fast tokenizer"):
        ChatTemplateTokenCounter(slow)
    with pytest.raises(ConfigError, match="api_style must be one of"):
        ChatTemplateTokenCounter(char_tokenizer()).layout([{"role": "user", "content": "a"}], api_style="vllm")


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 6), st.booleans(), st.booleans())
def test_agrees_with_server_provenance(chatml, seed, turns, system, with_tools):
    provenance = pytest.importorskip("akv.system.context.provenance")
    tokenizer, counter = chatml
    messages = random_conversation(random.Random(seed), turns, system=system)
    tools = TOOLS if with_tools else None
    rendered = counter.render(messages, tools=tools)
    template = provenance.ChatTemplate(tokenizer.chat_template)
    inputs = sglang_template_inputs(messages, tools)  # what the reference server renders
    owned = template.render_owned(list(inputs.messages), tools=inputs.tools and list(inputs.tools),
                                  add_generation_prompt=True,
                                  **tokenizer.special_tokens_map)
    server = provenance.token_provenance(owned, tokenizer)
    assert list(server.token_ids) == list(rendered.token_ids)
    assert list(server.owners) == list(rendered.owners)
