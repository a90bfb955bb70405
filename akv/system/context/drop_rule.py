"""Parse and validate the ``drop_rule`` request field (README "drop_rule").

Shapes (``type`` selects one; unknown keys and keys starting with ``_`` are refused):

- ``{"type": "message_drop", "drop_messages": {"4": [1, 2]}}``: the same as ``drop_message``.
- ``{"type": "text_drop", "drop_messages": [entry per message]}``: each entry is ``null`` or
  ``{"role": ..., "content": null | str | [str], "occurrence": int | [int]}``: exact, case-sensitive
  substrings of that message's string content (1-based occurrence per selector, overlapping matches
  counted, default 1), all dropped after the latest user message.
- ``{"type": "keep_text_drop", "full_messages": [...], "force": false}``: ``messages`` is a visible
  projection of ``full_messages`` (see :mod:`akv.system.context.projection`).
- ``{"type": "thinking_drop"}``: each assistant message's reasoning is dropped right after it; with
  ``"thinking": {"9": [2, 5]}`` only as scheduled (after message 9, the reasoning of assistant
  messages 2 and 5; ``{}`` drops none), and ``"drop_messages"`` adds whole-message drops as
  ``drop_message`` does (a message whose reasoning was dropped may later be dropped whole).

Every failure raises a :class:`~akv.system.context.rules.RuleError` naming the field
(``drop_rule.drop_messages[3].content[1]``) and the value; sizes are bounded by the ``MAX_*`` limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from akv.system.context.compiler import merge_spans
from akv.system.context.rules import (
    ContextRules,
    DoubleDropError,
    Drop,
    RuleError,
    RuleRangeError,
    RuleShapeError,
    RuleSizeError,
    is_plain_request,
    parse_rules,
)

MAX_TEXT_MESSAGES = 4096
MAX_SELECTORS = 1024
MAX_TEXT_BYTES = 16 << 20
MAX_PATTERN_BYTES = 1 << 20
MAX_MATCHES = 1 << 20
MAX_FULL_MESSAGES = 1 << 16

TYPES = ("message_drop", "text_drop", "keep_text_drop", "thinking_drop")
_KEYS = {
    "message_drop": {"type", "drop_messages"},
    "text_drop": {"type", "drop_messages"},
    "keep_text_drop": {"type", "full_messages", "force"},
    "thinking_drop": {"type", "thinking", "drop_messages"},
}


class ExclusiveFieldsError(RuleError):
    """``drop_rule`` and ``drop_message`` were both sent."""


@dataclass(frozen=True)
class TextSelection:
    """Characters of message ``message``'s content to drop: sorted, merged half-open ``ranges``;
    ``whole`` when they cover all of it (the message is then dropped with its template tokens).
    ``content`` is the text they index (the rendered message must still carry it)."""

    message: int
    ranges: tuple[tuple[int, int], ...]
    whole: bool
    content: str


@dataclass(frozen=True)
class TextDrop:
    """Text spans dropped after message ``anchor`` (the latest user message)."""

    anchor: int
    selections: tuple[TextSelection, ...]


@dataclass(frozen=True)
class KeepTextDrop:
    """``messages`` are a visible projection of ``full_messages``; ``force`` serves the visible list
    as it is when the projection does not match."""

    full_messages: tuple[Any, ...]
    force: bool


@dataclass(frozen=True)
class ThinkingDrop:
    """Drop assistant reasoning: by ``schedule`` (anchor, assistant ids), or, when None, each
    message's right after it."""

    schedule: tuple[Drop, ...] | None = None


SpanRule = Union[TextDrop, KeepTextDrop, ThinkingDrop]


@dataclass(frozen=True)
class RequestRules:
    """The cache operations of one request: whole-message drops and repositions in ``rules``, plus at
    most one span rule (text, projection or thinking drops) resolved once the prompt is rendered."""

    rules: ContextRules
    span: SpanRule | None = None


def is_context_request(drop_message: Any, drop_rule: Any, reposition: Any) -> bool:
    """True when any AKV field asks for a cache operation (an explicit ``drop_rule`` always does)."""
    return drop_rule is not None or not is_plain_request(drop_message, reposition)


def parse_request_rules(
    drop_message: Any, drop_rule: Any, reposition: Any, messages: Sequence[Mapping[str, Any]]
) -> RequestRules:
    """Validate the three fields together against ``messages`` (as the template receives them)."""
    if drop_rule is None:
        return RequestRules(parse_rules(drop_message, reposition, len(messages)))
    if drop_message is not None:
        raise ExclusiveFieldsError("drop_rule", _type_of(drop_rule),
                                   "drop_rule and drop_message are exclusive; send one")
    if not isinstance(drop_rule, Mapping):
        raise RuleShapeError("drop_rule", drop_rule, f"expected an object, got {type(drop_rule).__name__}")
    kind = drop_rule.get("type")
    if kind not in TYPES:
        raise RuleShapeError("drop_rule.type", kind, f"type {kind!r} is not one of {list(TYPES)}")
    for key in drop_rule:
        if key not in _KEYS[kind]:
            why = "is reserved" if isinstance(key, str) and key.startswith("_") else f"is not a {kind} field"
            raise RuleShapeError(f"drop_rule.{key}", None, f"key {key!r} {why}")
    if kind == "message_drop":
        if drop_rule.get("drop_messages") is None:
            raise RuleShapeError("drop_rule.drop_messages", None, "message_drop needs drop_messages")
        return RequestRules(_renamed(drop_rule["drop_messages"], reposition, len(messages), "drop_rule.drop_messages"))
    if kind == "thinking_drop":
        whole = _renamed(drop_rule.get("drop_messages"), reposition, len(messages), "drop_rule.drop_messages")
        if "thinking" not in drop_rule:
            return RequestRules(whole, ThinkingDrop())
        return RequestRules(whole, ThinkingDrop(_thinking_schedule(drop_rule["thinking"], messages, whole)))
    if kind == "text_drop":
        rules = parse_rules(None, reposition, len(messages))
        return RequestRules(rules, _text_drop(drop_rule.get("drop_messages"), messages))
    # keep_text_drop: reposition ids index the full messages, checked once they are known
    return RequestRules(ContextRules.EMPTY, _keep_text_drop(drop_rule))


def _type_of(drop_rule: Any) -> Any:
    return drop_rule.get("type") if isinstance(drop_rule, Mapping) else drop_rule


def _renamed(drop_messages: Any, reposition: Any, n_messages: int, field: str) -> ContextRules:
    """``parse_rules`` with errors naming ``field`` instead of ``drop_message``."""
    try:
        return parse_rules(drop_messages, reposition, n_messages)
    except RuleError as exc:
        if not exc.field.startswith("drop_message"):
            raise
        raise type(exc)(field + exc.field[len("drop_message"):], exc.value, str(exc).split(": ", 1)[1]) from exc


def _thinking_schedule(value: Any, messages: Sequence[Mapping[str, Any]], whole: ContextRules) -> tuple[Drop, ...]:
    if not isinstance(value, Mapping):
        raise RuleShapeError("drop_rule.thinking", _short(value), f"expected an object, got {type(value).__name__}")
    schedule = _renamed(value, None, len(messages), "drop_rule.thinking").drops
    dropped_at = {m: d.anchor for d in whole.drops for m in d.messages}
    for drop in schedule:
        for k, i in enumerate(drop.messages):
            field = f"drop_rule.thinking[{str(drop.anchor)!r}][{k}]"
            role = messages[i].get("role")
            if role != "assistant":
                raise RuleShapeError(field, i, f"message {i} is a {role} message; only assistant reasoning drops")
            if dropped_at.get(i, drop.anchor + 1) <= drop.anchor:
                raise DoubleDropError(field, i, f"message {i} is dropped whole by anchor {dropped_at[i]} already")
    return schedule


def _text_drop(entries: Any, messages: Sequence[Mapping[str, Any]]) -> TextDrop:
    field = "drop_rule.drop_messages"
    if not isinstance(entries, list):
        raise RuleShapeError(field, _short(entries), "text_drop needs a list with one entry per message")
    if len(entries) > MAX_TEXT_MESSAGES:
        raise RuleSizeError(field, len(entries), f"{len(entries)} entries, at most {MAX_TEXT_MESSAGES}")
    if len(entries) != len(messages):
        raise RuleSizeError(field, len(entries), f"{len(entries)} entries for {len(messages)} messages")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    anchor = users[-1] if users else -1
    budget = _Budget()
    selections = []
    for i, entry in enumerate(entries):
        selection = _text_selection(entry, messages[i], f"{field}[{i}]", i, budget)
        if selection is None:
            continue
        if i > anchor:
            where = f"the latest user message {anchor}" if users else "a user message; there is none"
            raise RuleRangeError(f"{field}[{i}]", i, f"message {i} is not at or before {where}")
        selections.append(selection)
    return TextDrop(anchor, tuple(selections))


@dataclass
class _Budget:
    text_bytes: int = 0
    pattern_bytes: int = 0
    matches: int = 0


def _text_selection(entry: Any, message: Mapping[str, Any], field: str, index: int, budget: _Budget
                    ) -> TextSelection | None:
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise RuleShapeError(field, _short(entry), f"expected null or an object, got {type(entry).__name__}")
    for key in entry:
        if key not in ("role", "content", "occurrence"):
            raise RuleShapeError(f"{field}.{key}", None, f"key {key!r} is not a text_drop entry field")
    role = entry.get("role")
    if role != message.get("role"):
        raise RuleShapeError(f"{field}.role", role, f"role {role!r} is not the message's role {message.get('role')!r}")
    selectors = entry.get("content")
    if selectors is None or selectors == "":
        if entry.get("occurrence") is not None:
            raise RuleShapeError(f"{field}.occurrence", entry["occurrence"], "an occurrence without content")
        return None
    single = isinstance(selectors, str)
    patterns = [selectors] if single else selectors
    if not isinstance(patterns, list) or not patterns:
        raise RuleShapeError(f"{field}.content", _short(selectors),
                             "expected null, a string or a non-empty list of strings")
    if len(patterns) > MAX_SELECTORS:
        raise RuleSizeError(f"{field}.content", len(patterns), f"{len(patterns)} selectors, at most {MAX_SELECTORS}")
    occurrences = _occurrences(entry.get("occurrence"), len(patterns), single, f"{field}.occurrence")
    content = message.get("content")
    if not isinstance(content, str):
        raise RuleShapeError(f"{field}.content", None,
                             f"messages[{index}] has {type(content).__name__} content; text_drop needs string content")
    budget.text_bytes += len(content.encode("utf-8", "surrogatepass"))
    if budget.text_bytes > MAX_TEXT_BYTES:
        raise RuleSizeError(field, budget.text_bytes,
                            f"{budget.text_bytes} content bytes searched, at most {MAX_TEXT_BYTES}")
    items = [f"{field}.content" if single else f"{field}.content[{j}]" for j in range(len(patterns))]
    for item, pattern, occurrence in zip(items, patterns, occurrences):
        if not isinstance(pattern, str) or not pattern:
            raise RuleShapeError(item, _short(pattern), "a selector must be a non-empty string")
        budget.pattern_bytes += len(pattern.encode("utf-8", "surrogatepass"))
        if budget.pattern_bytes > MAX_PATTERN_BYTES:
            raise RuleSizeError(item, budget.pattern_bytes,
                                f"{budget.pattern_bytes} pattern bytes, at most {MAX_PATTERN_BYTES}")
        budget.matches += occurrence
        if budget.matches > MAX_MATCHES:
            raise RuleSizeError(item, budget.matches, f"{budget.matches} matches to find, at most {MAX_MATCHES}")
    ranges = []
    for item, pattern, occurrence in zip(items, patterns, occurrences):
        start = nth_occurrence(content, pattern, occurrence)
        if start < 0:
            raise RuleRangeError(item, _short(pattern, 80),
                                 f"occurrence {occurrence} of the selector is not in messages[{index}].content")
        ranges.append((start, start + len(pattern)))
    merged = merge_spans(ranges)
    return TextSelection(index, merged, merged == ((0, len(content)),), content)


def _occurrences(value: Any, n: int, single: bool, field: str) -> list[int]:
    if value is None:
        return [1] * n
    values = [value] if single or type(value) is int else value
    if not isinstance(values, list) or len(values) != n:
        raise RuleShapeError(field, _short(value), f"expected {'an int' if single else f'{n} ints, one per selector'}")
    for j, v in enumerate(values):
        if type(v) is not int or not 1 <= v <= MAX_MATCHES:
            raise RuleShapeError(field if single else f"{field}[{j}]", v,
                                 f"occurrence must be an int in 1..{MAX_MATCHES}")
    return values


def nth_occurrence(text: str, pattern: str, occurrence: int) -> int:
    """Start of the ``occurrence``-th (1-based) match of ``pattern`` in ``text``, overlapping matches
    counted; -1 when there are fewer."""
    at = -1
    for _ in range(occurrence):
        at = text.find(pattern, at + 1)
        if at < 0:
            return -1
    return at


def _keep_text_drop(drop_rule: Mapping[str, Any]) -> KeepTextDrop:
    full = drop_rule.get("full_messages")
    if not isinstance(full, list) or not full:
        raise RuleShapeError("drop_rule.full_messages", _short(full),
                             "keep_text_drop needs a non-empty list of messages")
    if len(full) > MAX_FULL_MESSAGES:
        raise RuleSizeError("drop_rule.full_messages", len(full), f"{len(full)} messages, at most {MAX_FULL_MESSAGES}")
    force = drop_rule.get("force", False)
    if type(force) is not bool:
        raise RuleShapeError("drop_rule.force", force, "expected true or false")
    return KeepTextDrop(tuple(full), force)


def _short(value: Any, limit: int = 120) -> Any:
    text = repr(value)
    return value if len(text) <= limit else text[:limit] + "..."
