"""`CachePolicy`: turns a chat payload plus the branch's history into the payload with AKV fields."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from akv.agent import checks
from akv.agent.context import DecisionContext, DecisionState, check_ids
from akv.agent.counting import TokenCounter
from akv.agent.errors import ConfigError, HistoryError, RuleError
from akv.agent.history import (
    EMPTY_PREFIX,
    CacheOperation,
    CacheOperationHistory,
    extend_digest,
    settings_digest,
)
from akv.agent.messages import parse_conversation
from akv.agent.jsonvalue import copy_json_pair, same_json, validate_json
from akv.agent.payload import check_payload, copy_json, with_fields
from akv.agent.protection import Protection
from akv.agent.routing import routing_key
from akv.agent.thinking import thinking_schedule
from akv.agent.tool import DropContextTool

Trigger = Callable[[DecisionContext], bool]
Selector = Callable[[DecisionContext], Iterable[int]]
RepositionRule = Callable[[DecisionContext], bool]


@dataclass(frozen=True)
class CachePolicy:
    """Decides drops and repositions at every completed turn (the end of each tool-call batch).

    `trigger` says when to drop (default: at every turn, if a selector is given), `selector` what,
    `reposition` when to compact positions. Protected messages (`protect_system`,
    `protect_first_user`, `exclude_tools`) and the current turn are never dropped. A drop smaller
    than `min_clear_messages` messages or `min_clear_tokens` tokens (counted by `counter`, which is
    used for nothing else) is skipped. With `keep_thinking_turns=N`, the reasoning of assistant
    messages older than the last N turns is dropped too (a `thinking_drop` rule then carries all
    drops, and the server keeps historical reasoning in the prompt)."""

    trigger: Trigger | None = None
    selector: Selector | None = None
    reposition: RepositionRule | None = None
    exclude_tools: Collection[str] = ()
    protect_system: bool = True
    protect_first_user: bool = True
    min_clear_messages: int = 1
    min_clear_tokens: int | None = None
    counter: TokenCounter | None = None
    keep_thinking_turns: int | None = None
    protection: Protection = field(init=False)

    def __post_init__(self) -> None:
        for name in ("trigger", "selector", "reposition"):
            rule = getattr(self, name)
            if rule is not None and not callable(rule):
                raise ConfigError(f"CachePolicy.{name} must be callable, got {rule!r}")
        if self.trigger is not None and self.selector is None:
            raise ConfigError("CachePolicy.trigger needs a selector (what to drop when it fires)")
        checks.positive_int("CachePolicy", "min_clear_messages", self.min_clear_messages)
        checks.positive_int("CachePolicy", "min_clear_tokens", self.min_clear_tokens, optional=True)
        checks.positive_int("CachePolicy", "keep_thinking_turns", self.keep_thinking_turns, optional=True)
        if self.min_clear_tokens is not None:
            checks.counter("CachePolicy (min_clear_tokens)", self.counter)
        protection = Protection(self.protect_system, self.protect_first_user, self.exclude_tools)
        object.__setattr__(self, "exclude_tools", protection.exclude_tools)
        object.__setattr__(self, "protection", protection)

    def drop_context_tool(self, name: str = "drop_context") -> DropContextTool:
        """The model-facing drop tool, with this policy's protection rules and drop minimums."""
        return DropContextTool(name, self.protection, self.min_clear_messages, self.min_clear_tokens, self.counter)

    def process(self, payload: Mapping[str, Any], history: CacheOperationHistory | None = None, *,
                api_style: str = "sglang", completed_call_message_ids: Sequence[int] | None = None,
                ) -> tuple[dict[str, Any], CacheOperationHistory]:
        """Return a deep copy of `payload` with the cumulative `drop_message`/`reposition` fields
        (under `extra_body` for api_style="openai") and the extended history. Decisions already in
        `history` are kept; only turns completed after it are decided. The history's `routing_key`
        is the conversation's `x-smg-routing-key` header value (`akv.agent.routing`)."""
        check_payload(payload, api_style)
        messages = payload.get("messages")
        conversation = parse_conversation(messages, completed_call_message_ids)
        settings = settings_digest(payload, api_style)
        key = routing_key(payload)
        start = 0
        if history is not None:
            _check_history(history, conversation.boundaries, messages, settings)
            if history.message_count == len(messages):
                if history.routing_key != key:
                    history = replace(history, routing_key=key)
                thinking = self._thinking(messages, conversation.boundaries, history)
                return with_fields(payload, copy_json(messages), history, api_style, thinking), history
            start = history.message_count
        if history is None or history.snapshot is None:
            snapshot, sent = copy_json_pair(messages, "messages")
        else:
            kept, added = copy_json_pair(messages, "messages", start)
            snapshot, sent = history.snapshot + kept, copy_json(messages[:start]) + added
        state = DecisionState(messages, conversation, self.protection.protected(conversation),
                              payload.get("tools"), payload.get("chat_template_kwargs"), api_style)
        operations = list(history.operations) if history is not None else []
        for op in operations:
            state.hide(op.drop)
            if op.reposition:
                state.compacted_count = len(state.hidden_order)
        previous = -1
        for turn, boundary in enumerate(conversation.boundaries, 1):
            if boundary >= start:
                op = self._decide(state, boundary, turn, previous)
                if op is not None:
                    operations.append(op)
            previous = boundary
        new_history = CacheOperationHistory.extending(history, tuple(operations), settings, snapshot, key)
        thinking = self._thinking(messages, conversation.boundaries, new_history)
        return with_fields(payload, sent, new_history, api_style, thinking), new_history

    def _thinking(self, messages: list[Any], boundaries: tuple[int, ...], history: CacheOperationHistory
                  ) -> dict[str, list[int]] | None:
        if self.keep_thinking_turns is None:
            return None
        dropped_at = {i: op.boundary for op in history.operations for i in op.drop}
        return thinking_schedule(messages, boundaries, self.keep_thinking_turns, dropped_at)

    def _decide(self, state: DecisionState, boundary: int, turn: int, previous: int) -> CacheOperation | None:
        state.admit_until(previous + 1)
        ctx = DecisionContext(state, boundary, turn)
        drop: tuple[int, ...] = ()
        if self.selector is not None and (self.trigger is None or _verdict(self.trigger, ctx)):
            roles, candidates = state.conversation.roles, state.candidates
            chosen = [i for i in check_ids(self.selector(ctx), ctx, self.selector)
                      if i in candidates.get(roles[i], ())]
            if len(chosen) >= self.min_clear_messages and (
                    self.min_clear_tokens is None or ctx.tokens(self.counter, chosen) >= self.min_clear_tokens):
                drop = tuple(chosen)
                state.hide(drop)
        reposition = False
        if self.reposition is not None and len(state.hidden_order) > state.compacted_count:
            reposition = _verdict(self.reposition, DecisionContext(state, boundary, turn, drop))
            if reposition:
                state.compacted_count = len(state.hidden_order)
        return CacheOperation(boundary, drop, reposition) if drop or reposition else None


def _verdict(rule: Callable[[DecisionContext], object], ctx: DecisionContext) -> bool:
    result = rule(ctx)
    if type(result) is not bool:
        raise RuleError(f"rule {rule!r} must return a bool at boundary {ctx.boundary}, got {result!r}")
    return result


def _check_history(history: object, boundaries: tuple[int, ...], messages: list[Any], settings: str) -> None:
    if not isinstance(history, CacheOperationHistory):
        raise HistoryError(f"history must be a CacheOperationHistory or None, got {type(history).__name__}")
    if history.settings_digest != settings:
        raise HistoryError("the model, tools or template settings (model, tools, chat_template_kwargs, "
                           "reasoning_effort, api_style) differ from those the history was decided under")
    count = history.message_count
    if count > len(messages):
        raise HistoryError(f"the history covers {count} messages but the payload has only {len(messages)}; it "
                           f"belongs to another branch")
    prefix = messages[:count]
    if history.snapshot is not None:
        same = same_json(history.snapshot, prefix)
    else:
        validate_json(messages, "messages")
        same = extend_digest(EMPTY_PREFIX, prefix) == history.prefix_digest
    if not same:
        raise HistoryError(f"messages 0..{count - 1} differ from those the history was decided on: an earlier "
                           f"message was edited, removed or reordered")
    known = set(boundaries)
    stray = [op.boundary for op in history.operations if op.boundary not in known]
    if stray:
        raise HistoryError(f"history operations at messages {stray} are not completed turns of this payload")
