"""Provenance on the official gpt-oss template, rendered from SGLang's chat-path inputs: ids equal
the template's own render, and each of the template's quirks lands on the right message."""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest

from akv.system.context.provenance import TokenProvenance, prompt_provenance
from akv.system.context.request import compile_request
from tests.gpt_oss.conversation import MESSAGES, rendered_ids, template_inputs

CONSTRAIN = 200003


def provenance(tokenizer: Any, n_messages: int) -> TokenProvenance:
    messages, tools = template_inputs(n_messages)
    return prompt_provenance(tokenizer, messages, tools=tools)


def message_text(tokenizer: Any, prov: TokenProvenance, message: int) -> str:
    return tokenizer.decode([int(t) for t, o in zip(prov.token_ids, prov.owners) if o == message])


@pytest.mark.parametrize("n_messages", range(2, len(MESSAGES) + 1))
def test_ids_equal_the_template_render_for_every_prefix(harmony_tokenizer: Any, n_messages: int) -> None:
    prov = provenance(harmony_tokenizer, n_messages)
    assert prov.token_ids.tolist() == rendered_ids(harmony_tokenizer, n_messages)
    assert prov.boundary_tokens.size == 0
    assert message_text(harmony_tokenizer, prov, n_messages) == "<|start|>assistant"


def test_analysis_is_kept_until_a_final_answer_follows(harmony_tokenizer: Any) -> None:
    before = provenance(harmony_tokenizer, 4)
    assert message_text(harmony_tokenizer, before, 2) == (
        "<|start|>assistant<|channel|>analysis<|message|>I should read A7 first.<|end|>"
        '<|start|>assistant to=functions.read_record<|channel|>commentary json<|message|>{"id": "A7"}<|call|>')
    after = provenance(harmony_tokenizer, 9)
    assert "analysis" not in message_text(harmony_tokenizer, after, 2)
    # The render is not prefix-stable: the two prompts part at message 2's first token.
    first_of_2 = int((before.owners == 2).nonzero()[0][0])
    common = next(i for i, (a, b) in enumerate(zip(before.token_ids, after.token_ids)) if a != b)
    assert common == first_of_2 + 2  # "<|start|>", "assistant", then "<|channel|>" vs " to"


def test_only_the_first_tool_call_of_a_message_is_rendered(harmony_tokenizer: Any) -> None:
    prov = provenance(harmony_tokenizer, 7)
    assert message_text(harmony_tokenizer, prov, 4) == (
        '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"q": "B2"}<|call|>')
    # Both results are labelled with the rendered call's name; the second call's arguments are nowhere.
    assert message_text(harmony_tokenizer, prov, 6) == (
        '<|start|>functions.search to=assistant<|channel|>commentary<|message|>"record C3: 7"<|end|>')
    assert '"C3"' not in prov.text
    assert message_text(harmony_tokenizer, prov, 5).endswith('<|message|>"B2 is \\"blue\\""<|end|>')


def test_calls_are_rendered_with_a_plain_json_content_type(harmony_tokenizer: Any) -> None:
    """The model emits ``<|channel|>commentary <|constrain|>json<|message|>``; history re-renders it
    as ``commentary json``, so a generated call's KV is never a prefix of the next prompt's."""
    prov = provenance(harmony_tokenizer, len(MESSAGES))
    assert CONSTRAIN not in prov.token_ids.tolist()
    assert prov.text.count("<|channel|>commentary json<|message|>") == 3
    generated = harmony_tokenizer.encode(
        ' to=functions.read_record<|channel|>commentary <|constrain|>json<|message|>{"id": "C3"}<|call|>',
        add_special_tokens=False)
    assert CONSTRAIN in generated


def test_the_dated_system_block_and_the_developer_block_belong_to_message_0(harmony_tokenizer: Any) -> None:
    prov = provenance(harmony_tokenizer, 2)
    head = message_text(harmony_tokenizer, prov, 0)
    assert head.startswith("<|start|>system<|message|>You are ChatGPT")
    assert f"Current date: {date.today():%Y-%m-%d}\n" in head
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in head
    assert message_text(harmony_tokenizer, prov, 1) == "<|start|>user<|message|>Read A7, then search for B2.<|end|>"
    without_system = prompt_provenance(harmony_tokenizer, [{"role": "user", "content": "hi"}])
    assert message_text(harmony_tokenizer, without_system, 0).endswith(
        "<|end|><|start|>user<|message|>hi<|end|>")
    assert "developer" not in without_system.text


def test_a_drop_covers_exactly_the_dropped_messages_tokens(harmony_tokenizer: Any) -> None:
    messages, tools = template_inputs(len(MESSAGES))
    compiled = compile_request(harmony_tokenizer, messages, tools=tools, drop_message={"6": [2, 3]}, reposition=[6])
    owners = compiled.provenance.owners
    drop = compiled.program.events[0]
    dropped = [t for start, end in drop.ranges for t in range(start, end)]
    assert dropped == [t for t in range(len(owners)) if owners[t] in (2, 3)]
    assert drop.at == int((owners <= 6).sum())


def test_reasoning_effort_reaches_the_system_block(harmony_tokenizer: Any) -> None:
    """SGLang passes a request's reasoning_effort as a template variable."""
    messages, tools = template_inputs(4)
    prov = prompt_provenance(harmony_tokenizer, messages, tools=tools, reasoning_effort="high")
    text = harmony_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                 reasoning_effort="high")
    assert prov.token_ids.tolist() == harmony_tokenizer.encode(text, add_special_tokens=False)
    assert "Reasoning: high\n" in message_text(harmony_tokenizer, prov, 0)
