"""Hooks for the patched ``anthropic/serving.py``: `context_management.edits` on `/v1/messages` become
the OpenAI-path drop fields of the converted request (decided by :mod:`akv.agent.anthropic` with this
server's token counts), the response carries `context_management.applied_edits`, and
`cache_read_input_tokens` counts cached and re-rotated KV."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.agent.anthropic import CLEAR_THINKING, CLEAR_TOOL_USES, ContextEdits, ContextManagementError, EditPlan
from akv.agent.anthropic import parse_context_management, plan_edits
from akv.agent.counting import TokenLayout
from akv.agent.templating import template_messages, template_tools
from akv.system.adapter.protocol import message_dict
from akv.system.adapter.serving import _CONVERTER
from akv.system.context.provenance import TokenProvenance, prompt_provenance
from akv.system.context.rules import Drop
from akv.system.context.thinking import retain_thinking, thinking_drops


@dataclass(frozen=True)
class Edited:
    """What the edits of one request did, kept on the Anthropic request for its response."""

    applied_edits: tuple[dict[str, Any], ...]
    original_input_tokens: int
    input_tokens: int


class _Counter:
    """Token spans per message from SGLang's tokenizer and template (the one ``thinking_drop`` renders
    with when ``thinking``); keeps the last provenance for the edits' token counts."""

    def __init__(self, tokenizer: Any, thinking: bool) -> None:
        source = getattr(tokenizer, "chat_template", None)
        self.tokenizer = tokenizer
        self.template = retain_thinking(source) if thinking and isinstance(source, str) else source
        self.provenance: TokenProvenance | None = None

    def layout(self, messages: Any, *, tools: Any = None, chat_template_kwargs: Any = None,
               api_style: str = "sglang") -> TokenLayout:
        self.provenance = prompt_provenance(self.tokenizer, list(messages), tools=list(tools) if tools else None,
                                            add_generation_prompt=True, template=self.template)
        return TokenLayout.from_owners(self.provenance.owners.tolist(), len(messages))


async def apply_edits(serving_chat: Any, anthropic_request: Any, chat_request: Any) -> None:
    """Validate `context_management` (a ``ValueError`` naming the field: HTTP 400), put the drop
    fields on ``chat_request`` and replace the field with the :class:`Edited` summary. The renders run
    in the context-request worker thread, off the event loop."""
    if getattr(anthropic_request, "context_management", None) is None:
        return
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(_CONVERTER, _apply_edits, serving_chat, anthropic_request, chat_request)


def _apply_edits(serving_chat: Any, anthropic_request: Any, chat_request: Any) -> None:
    value = anthropic_request.context_management
    edits = parse_context_management(value, has_tools=bool(chat_request.tools))
    if edits.thinking is not None and _thinking_left_out(serving_chat, anthropic_request):
        index = next(i for i, edit in enumerate(value["edits"]) if edit.get("type") == CLEAR_THINKING)
        raise ContextManagementError(
            f"context_management.edits[{index}].type",
            f"{CLEAR_THINKING!r} needs a server started with --reasoning-parser: without one, the thinking "
            "blocks of earlier assistant turns are left out of the prompt, so none can be kept")
    tools = template_tools([t.model_dump() for t in chat_request.tools]) if chat_request.tools else None
    messages = template_messages([message_dict(m) for m in chat_request.messages])
    counter = _Counter(serving_chat.tokenizer_manager.tokenizer,
                       edits.thinking is not None and edits.thinking.keep_turns is not None)
    plan = plan_edits(messages, edits, counter, tools=list(tools) if tools else None)
    for key, field in plan.fields.items():
        setattr(chat_request, key, field)
    layout = counter.layout(messages, tools=tools)
    anthropic_request.context_management = _summary(edits, plan, counter.provenance, messages, layout)


def _thinking_left_out(serving_chat: Any, anthropic_request: Any) -> bool:
    """Whether SGLang's conversion left out thinking blocks of assistant turns: it rewraps them in the
    reasoning parser's markers and drops them when the server has no parser."""
    if getattr(serving_chat, "_reasoning_detector", None) is not None:
        return False
    return any(getattr(block, "type", None) == "thinking" and getattr(block, "thinking", None)
               for message in anthropic_request.messages if message.role == "assistant"
               and not isinstance(message.content, str) for block in message.content)


def applied(anthropic_request: Any) -> dict[str, Any] | None:
    """The response's `context_management` (None for a request without edits)."""
    edited = getattr(anthropic_request, "context_management", None)
    return {"applied_edits": list(edited.applied_edits)} if isinstance(edited, Edited) else None


def count_tokens(anthropic_request: Any, input_tokens: int) -> dict[str, Any]:
    """The count_tokens body: with edits, the prompt after them and Anthropic's original count."""
    edited = getattr(anthropic_request, "context_management", None)
    if not isinstance(edited, Edited):
        return {"input_tokens": input_tokens}
    return {"input_tokens": edited.input_tokens,
            "context_management": {"original_input_tokens": edited.original_input_tokens}}


def cache_read_tokens(usage: Any) -> int:
    """Prompt tokens read from the cache: cached plus re-rotated."""
    details = getattr(usage, "prompt_tokens_details", None)
    return (getattr(details, "cached_tokens", 0) or 0) + (getattr(details, "repos_tokens", 0) or 0)


def _summary(edits: ContextEdits, plan: EditPlan, provenance: Any, messages: list[Any], layout: TokenLayout) -> Edited:
    owners = provenance.owners
    n_prompt = layout.prompt_tokens
    hidden = np.zeros(n_prompt, dtype=bool)
    hidden[np.isin(owners, plan.dropped)] = True
    out = []
    if edits.thinking is not None and plan.thinking:
        partial = [i for i in plan.thinking if i not in plan.dropped]
        thought = np.zeros(n_prompt, dtype=bool)
        for drop in thinking_drops(provenance, messages, [Drop(len(messages) - 1, tuple(partial))]):
            for start, end in drop.ranges:
                thought[start:end] = True
        hidden |= thought
        out.append({"type": CLEAR_THINKING, "cleared_thinking_turns": len(plan.thinking),
                    "cleared_input_tokens": int(thought.sum())})
    if edits.tool_uses is not None and plan.dropped:
        out.append({"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(plan.tool_results),
                    "cleared_input_tokens": int(np.isin(owners, plan.dropped).sum())})
    return Edited(tuple(out), n_prompt, n_prompt - int(hidden.sum()))
