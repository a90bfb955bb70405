"""One chat request end to end: validate the fields, render with provenance, compile the program."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv.system.context.compiler import compile_program, compile_token_drops, merge_drops, message_drops
from akv.system.context.drop_rule import KeepTextDrop, RequestRules, TextDrop, ThinkingDrop, parse_request_rules
from akv.system.context.program import ContextProgram
from akv.system.context.projection import Projection, projection_drops, resolve_keep_text
from akv.system.context.provenance import TokenProvenance, chat_template, prompt_provenance
from akv.system.context.rules import ContextRules
from akv.system.context.spans import Render, text_drops
from akv.system.context.thinking import retain_thinking, thinking_drops


@dataclass(frozen=True)
class CompiledRequest:
    """The parsed rules, the prompt's token provenance and the compiled program of one request."""

    rules: ContextRules
    provenance: TokenProvenance
    program: ContextProgram


def render_inputs(
    messages: Sequence[Mapping[str, Any]], rules: RequestRules, full_messages: Sequence[Mapping[str, Any]] | None,
    reposition: Any,
) -> tuple[Sequence[Mapping[str, Any]], RequestRules]:
    """What to render for a request: ``keep_text_drop`` swaps in ``full_messages`` (already validated
    like ``messages``); every other request renders its own messages."""
    if isinstance(rules.span, KeepTextDrop):
        if full_messages is None:
            raise ValueError("full_messages: keep_text_drop needs the validated full messages")
        return resolve_keep_text(rules.span, messages, full_messages, reposition)
    return messages, rules


def template_for(rules: RequestRules, template: str) -> str:
    """The chat template a request renders with (historical reasoning kept for ``thinking_drop``)."""
    return retain_thinking(template) if isinstance(rules.span, ThinkingDrop) else template


def compile_rules(provenance: TokenProvenance, messages: Sequence[Mapping[str, Any]], rules: RequestRules,
                  render: Render) -> ContextProgram:
    """The program of a rendered request; ``messages`` are the ones rendered and ``render`` renders
    messages as they were (it places text spans)."""
    n = len(messages)
    span = rules.span
    if span is None:
        return compile_program(provenance.token_ids, provenance.owners, rules.rules, n)
    if isinstance(span, TextDrop):
        drops = text_drops(provenance, messages, span, render)
    elif isinstance(span, ThinkingDrop):
        drops = thinking_drops(provenance, messages, span.schedule)
    elif isinstance(span, Projection):
        drops = projection_drops(provenance, messages, span, render)
    else:
        raise TypeError(f"rules.span: {type(span).__name__} is not resolved; call render_inputs first")
    drops = merge_drops(message_drops(provenance.owners, rules.rules.drops) + drops)
    return compile_token_drops(provenance.token_ids, provenance.owners, drops, rules.rules.repositions, n)


def compile_request(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    drop_message: Any = None,
    reposition: Any = None,
    drop_rule: Any = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
    **template_variables: Any,
) -> CompiledRequest:
    """Rules are checked before rendering, so a bad request fails without touching the tokenizer.

    For ``keep_text_drop`` the full messages are taken from ``drop_rule`` as they are. Raises
    :class:`~akv.system.context.rules.RuleError` or
    :class:`~akv.system.context.provenance.ProvenanceError` (both ``ValueError``: HTTP 400).
    """
    rules = parse_request_rules(drop_message, drop_rule, reposition, messages)
    full = list(rules.span.full_messages) if isinstance(rules.span, KeepTextDrop) else None
    rendered, rules = render_inputs(messages, rules, full, reposition)
    return compile_parsed(tokenizer, rendered, rules, tools=tools, add_generation_prompt=add_generation_prompt,
                          template=template, **template_variables)


def compile_parsed(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    rules: RequestRules,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    **template_variables: Any,
) -> CompiledRequest:
    """Render ``messages`` (what :func:`render_inputs` chose) with provenance and compile ``rules``;
    ``prompt_ids`` is the server's own encoding of that render, if known (it is then not encoded again)."""
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(source, str):
        source = template_for(rules, source)
    provenance = prompt_provenance(
        tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt, template=source,
        prompt_ids=prompt_ids, **template_variables,
    )
    context = {**getattr(tokenizer, "special_tokens_map", {}), **template_variables}

    def render(variant: Sequence[Mapping[str, Any]]) -> str:
        return chat_template(source).render(variant, tools=tools, add_generation_prompt=add_generation_prompt,
                                            **context)

    program = compile_rules(provenance, messages, rules, render)
    return CompiledRequest(rules=rules.rules, provenance=provenance, program=program)
