"""One chat request end to end: validate the fields, render with provenance, compile the program."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv.system.context.compiler import compile_program
from akv.system.context.program import ContextProgram
from akv.system.context.provenance import TokenProvenance, prompt_provenance
from akv.system.context.rules import ContextRules, parse_rules


@dataclass(frozen=True)
class CompiledRequest:
    """The parsed rules, the prompt's token provenance and the compiled program of one request."""

    rules: ContextRules
    provenance: TokenProvenance
    program: ContextProgram


def compile_request(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    drop_message: Any = None,
    reposition: Any = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_variables: Any,
) -> CompiledRequest:
    """Rules are checked before rendering, so a bad request fails without touching the tokenizer.

    Raises :class:`~akv.system.context.rules.RuleError` or
    :class:`~akv.system.context.provenance.ProvenanceError` (both ``ValueError``: HTTP 400).
    """
    rules = parse_rules(drop_message, reposition, len(messages))
    provenance = prompt_provenance(
        tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_variables
    )
    program = compile_program(provenance.token_ids, provenance.owners, rules, len(messages))
    return CompiledRequest(rules=rules, provenance=provenance, program=program)
