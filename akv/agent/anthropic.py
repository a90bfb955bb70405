"""Anthropic context editing (`context_management.edits`) as AKV drops, on `CachePolicy`'s rules.

`clear_tool_uses_20250919` is a `CachePolicy` with `ResultSelection(keep)` (the `keep` newest tool
results stay), a `TokenTrigger` (`input_tokens`) or `ResultTrigger` (`tool_uses`), `exclude_tools` and
`min_clear_tokens` (`clear_at_least`); with `clear_tool_inputs: true` the assistant message that made
the calls is dropped too once all its results are (whole: its text and reasoning go with it).
`clear_thinking_20251015` is `keep_thinking_turns` (`keep: "all"` clears nothing). The policy decides
at every completed tool-call batch of the message list, so each request of a conversation repeats the
drops of the one before and the server reuses their KV. Messages are OpenAI-style (what the server
renders); a server passes its own exact `TokenCounter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv.agent.counting import TokenCounter
from akv.agent.errors import PayloadError
from akv.agent.policy import CachePolicy
from akv.agent.selectors import ResultSelection
from akv.agent.triggers import ResultTrigger, TokenTrigger

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
_TOOL_USES_KEYS = frozenset({"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"})
_THINKING_KEYS = frozenset({"type", "keep"})


class ContextManagementError(PayloadError):
    """A `context_management` value the server cannot honour; `field` is its path in the body."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)


@dataclass(frozen=True)
class ClearToolUses:
    """`clear_tool_uses_20250919` with its defaults filled in; `clear_at_least` None: no minimum."""

    trigger_unit: str  # "input_tokens" or "tool_uses"
    trigger_value: int
    keep: int
    clear_at_least: int | None
    exclude_tools: frozenset[str]
    clear_tool_inputs: bool


@dataclass(frozen=True)
class ClearThinking:
    """`clear_thinking_20251015`: the newest `keep_turns` turns keep their reasoning."""

    keep_turns: int | None  # None: keep all


@dataclass(frozen=True)
class ContextEdits:
    """The validated edits of one request, at most one of each type."""

    tool_uses: ClearToolUses | None
    thinking: ClearThinking | None


@dataclass(frozen=True)
class EditPlan:
    """The AKV fields to add to the OpenAI-style payload (`drop_message` or a `thinking_drop`
    `drop_rule`), the messages dropped whole (`tool_results`: the tool results among them) and the
    assistant messages whose reasoning is dropped."""

    fields: dict[str, Any]
    dropped: tuple[int, ...]
    tool_results: tuple[int, ...]
    thinking: tuple[int, ...]


def parse_context_management(value: Any, *, has_tools: bool, field: str = "context_management") -> ContextEdits:
    """Validate Anthropic's `context_management` object; every error names the field and value."""
    if not isinstance(value, Mapping):
        raise ContextManagementError(field, f"expected an object, got {type(value).__name__}")
    extra = sorted(set(value) - {"edits"})
    if extra:
        raise ContextManagementError(f"{field}.{extra[0]}", "unknown field")
    edits = value.get("edits", [])
    if not isinstance(edits, list):
        raise ContextManagementError(f"{field}.edits", f"expected a list, got {type(edits).__name__}")
    tool_uses: ClearToolUses | None = None
    thinking: ClearThinking | None = None
    for i, edit in enumerate(edits):
        where = f"{field}.edits[{i}]"
        if not isinstance(edit, Mapping):
            raise ContextManagementError(where, f"expected an object, got {type(edit).__name__}")
        kind = edit.get("type")
        if kind == CLEAR_TOOL_USES:
            if tool_uses is not None:
                raise ContextManagementError(f"{where}.type", f"{kind!r} is given twice")
            if not has_tools:
                raise ContextManagementError(f"{where}.type", f"{kind!r} needs a request with tools")
            tool_uses = _tool_uses(edit, where)
        elif kind == CLEAR_THINKING:
            if thinking is not None:
                raise ContextManagementError(f"{where}.type", f"{kind!r} is given twice")
            if tool_uses is not None:
                raise ContextManagementError(f"{where}.type", f"{kind!r} must come before {CLEAR_TOOL_USES!r}")
            thinking = _thinking(edit, where)
        else:
            raise ContextManagementError(f"{where}.type", f"unknown edit type {kind!r} (supported: "
                                         f"{CLEAR_TOOL_USES!r}, {CLEAR_THINKING!r})")
    return ContextEdits(tool_uses, thinking)


def plan_edits(messages: Sequence[Mapping[str, Any]], edits: ContextEdits, counter: TokenCounter, *,
               tools: Sequence[Mapping[str, Any]] | None = None) -> EditPlan:
    """Run the edits' `CachePolicy` over `messages` (OpenAI-style, as the server renders them)."""
    edit = edits.tool_uses
    policy_args: dict[str, Any] = {}
    if edit is not None:
        trigger = (TokenTrigger(edit.trigger_value, counter) if edit.trigger_unit == "input_tokens"
                   else ResultTrigger(edit.trigger_value))
        selector = ResultSelection(edit.keep)
        policy_args.update(trigger=trigger, selector=_WithCalls(selector) if edit.clear_tool_inputs else selector,
                           exclude_tools=edit.exclude_tools, min_clear_tokens=edit.clear_at_least,
                           counter=counter if edit.clear_at_least is not None else None)
    if edits.thinking is not None and edits.thinking.keep_turns is not None:
        policy_args["keep_thinking_turns"] = edits.thinking.keep_turns
    payload: dict[str, Any] = {"messages": list(messages)}
    if tools:
        payload["tools"] = list(tools)
    out, history = CachePolicy(**policy_args).process(payload)
    dropped = tuple(sorted(i for op in history.operations for i in op.drop))
    fields = {k: out[k] for k in ("drop_message", "drop_rule") if k in out}
    rule = out.get("drop_rule")
    thinking = tuple(sorted(i for ids in rule["thinking"].values() for i in ids)) if rule else ()
    results = tuple(i for i in dropped if messages[i].get("role") == "tool")
    return EditPlan(fields, dropped, results, thinking)


@dataclass(frozen=True)
class _WithCalls:
    """`clear_tool_inputs`: the selected tool results, plus each calling assistant message once all
    its results are selected or already dropped."""

    results: ResultSelection

    def __call__(self, ctx: Any) -> list[int]:
        chosen = set(self.results(ctx))
        gone = chosen | set(ctx.hidden)
        conversation = ctx.conversation
        for batch in conversation.batches:
            if batch.end <= ctx.boundary and all(r in gone for r in batch.results):
                chosen.add(batch.assistant)
        return sorted(chosen)


def _tool_uses(edit: Mapping[str, Any], where: str) -> ClearToolUses:
    _known(edit, _TOOL_USES_KEYS, where)
    unit, value = _amount(edit, "trigger", where, ("input_tokens", "tool_uses"), ("input_tokens", DEFAULT_TRIGGER_TOKENS))
    _, keep = _amount(edit, "keep", where, ("tool_uses",), ("tool_uses", DEFAULT_KEEP_TOOL_USES))
    if unit == "tool_uses" and keep > value:
        raise ContextManagementError(f"{where}.keep.value", f"keeps {keep} tool uses, more than the trigger's {value}")
    least = _amount(edit, "clear_at_least", where, ("input_tokens",), None)
    exclude = edit.get("exclude_tools", [])
    if not isinstance(exclude, list) or not all(isinstance(t, str) and t for t in exclude):
        raise ContextManagementError(f"{where}.exclude_tools", f"expected a list of tool names, got {exclude!r}")
    inputs = edit.get("clear_tool_inputs", False)
    if type(inputs) is not bool:
        raise ContextManagementError(f"{where}.clear_tool_inputs", f"expected true or false, got {inputs!r}")
    return ClearToolUses(unit, value, keep, least[1] if least else None, frozenset(exclude), inputs)


def _thinking(edit: Mapping[str, Any], where: str) -> ClearThinking:
    _known(edit, _THINKING_KEYS, where)
    if edit.get("keep") == "all":
        return ClearThinking(None)
    _, keep = _amount(edit, "keep", where, ("thinking_turns",), ("thinking_turns", DEFAULT_KEEP_THINKING_TURNS))
    return ClearThinking(keep)


def _known(edit: Mapping[str, Any], keys: frozenset[str], where: str) -> None:
    extra = sorted(set(edit) - keys)
    if extra:
        raise ContextManagementError(f"{where}.{extra[0]}", f"unknown field for {edit.get('type')!r}")


def _amount(edit: Mapping[str, Any], key: str, where: str, units: tuple[str, ...],
            default: tuple[str, int] | None) -> tuple[str, int] | None:
    if key not in edit or edit[key] is None:
        return default
    value = edit[key]
    if not isinstance(value, Mapping) or set(value) != {"type", "value"}:
        raise ContextManagementError(f"{where}.{key}", f"expected {{'type': ..., 'value': ...}}, got {value!r}")
    if value["type"] not in units:
        raise ContextManagementError(f"{where}.{key}.type", f"unknown unit {value['type']!r} (expected one of "
                                     f"{list(units)})")
    n = value["value"]
    if type(n) is not int or n < 1:
        raise ContextManagementError(f"{where}.{key}.value", f"expected a positive integer, got {n!r}")
    return value["type"], n
