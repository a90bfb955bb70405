"""What a rule sees at one decision boundary (`DecisionContext`) and the running state behind it."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from akv.agent.counting import TokenCounter, TokenLayout
from akv.agent.errors import RuleError, TokenCountError
from akv.agent.messages import Conversation
from akv.agent.receipts import ModelRequest, find_model_requests


@dataclass
class _CountCache:
    counter: TokenCounter  # held so that no other counter can take its id() while the state lives
    layout: TokenLayout
    prefix: list[int]
    hidden_seen: int = 0
    hidden_tokens: int = 0
    compacted_seen: int = 0
    compacted_tokens: int = 0


@dataclass
class DecisionState:
    """Mutable state of one `process()` run; rules see it only through `DecisionContext`."""

    messages: Sequence[Mapping[str, object]]
    conversation: Conversation
    protected: list[bool]
    tools: Sequence[Mapping[str, object]] | None
    chat_template_kwargs: Mapping[str, object] | None
    api_style: str
    hidden: set[int] = field(default_factory=set)
    hidden_order: list[int] = field(default_factory=list)
    compacted_count: int = 0
    candidates: dict[str, dict[int, None]] = field(default_factory=dict)
    admitted_until: int = 0
    counts: dict[int, _CountCache] = field(default_factory=dict)
    requests: dict[str, tuple[tuple[ModelRequest, ...], list[int]]] = field(default_factory=dict)

    def hide(self, ids: Sequence[int]) -> None:
        roles, candidates = self.conversation.roles, self.candidates
        self.hidden.update(ids)
        self.hidden_order.extend(ids)
        for i in ids:
            pool = candidates.get(roles[i])
            if pool is not None:
                pool.pop(i, None)

    def admit_until(self, end: int) -> None:
        """Make messages `< end` that are neither hidden nor protected candidates for dropping."""
        roles, protected, hidden, candidates = self.conversation.roles, self.protected, self.hidden, self.candidates
        for i in range(self.admitted_until, end):
            if not protected[i] and i not in hidden:
                pool = candidates.get(roles[i])
                if pool is None:
                    pool = candidates[roles[i]] = {}
                pool[i] = None
        self.admitted_until = max(self.admitted_until, end)

    def count(self, counter: TokenCounter) -> _CountCache:
        cache = self.counts.get(id(counter))
        if cache is None:
            layout = counter.layout(self.messages, tools=self.tools,
                                    chat_template_kwargs=self.chat_template_kwargs, api_style=self.api_style)
            if not isinstance(layout, TokenLayout) or len(layout.spans) != len(self.messages):
                raise TokenCountError(f"{type(counter).__name__}.layout must return a TokenLayout with one span "
                                      f"per message ({len(self.messages)})")
            prefix = [0]
            prefix.extend(end for _, end in layout.spans)
            cache = self.counts[id(counter)] = _CountCache(counter, layout, prefix)
        spans = cache.layout.spans
        if cache.hidden_seen < len(self.hidden_order):
            cache.hidden_tokens += sum(spans[i][1] - spans[i][0] for i in self.hidden_order[cache.hidden_seen:])
            cache.hidden_seen = len(self.hidden_order)
        if cache.compacted_seen < self.compacted_count:
            cache.compacted_tokens += sum(spans[i][1] - spans[i][0]
                                          for i in self.hidden_order[cache.compacted_seen:self.compacted_count])
            cache.compacted_seen = self.compacted_count
        return cache


class DecisionContext:
    """Read-only view of the conversation at one boundary, handed to triggers, selectors and
    reposition rules. Valid only during the rule call.

    `boundary` is the message id just completed, `turn` its 1-based index among completed turns.
    For triggers and selectors `hidden` holds what was dropped before this boundary; for reposition
    rules it also holds `dropping`, the ids dropped at this boundary."""

    __slots__ = ("_state", "boundary", "turn", "dropping")

    def __init__(self, state: DecisionState, boundary: int, turn: int, dropping: tuple[int, ...] = ()) -> None:
        self._state = state
        self.boundary = boundary
        self.turn = turn
        self.dropping = dropping

    @property
    def messages(self) -> Sequence[Mapping[str, object]]:
        """The payload's messages (all of them; rules must only use ids up to `boundary`)."""
        return self._state.messages

    @property
    def conversation(self) -> Conversation:
        return self._state.conversation

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The completed-turn boundaries up to and including this one."""
        return self._state.conversation.boundaries[:self.turn]

    @property
    def hidden(self) -> frozenset[int]:
        return frozenset(self._state.hidden)

    @property
    def candidates(self) -> tuple[int, ...]:
        """Ids that may be dropped now, ascending: before the current turn, not hidden, not protected."""
        return tuple(self.droppable())

    def droppable(self, roles: Collection[str] | None = None) -> Iterator[int]:
        """The `candidates` with one of `roles` (all roles if None), ascending, lazily."""
        pools = self._state.candidates
        chosen = [pools[r] for r in (pools if roles is None else roles) if r in pools]
        return iter(chosen[0]) if len(chosen) == 1 else heapq.merge(*chosen)

    def role(self, message_id: int) -> str:
        return self._state.conversation.roles[message_id]

    def tool_name(self, message_id: int) -> str | None:
        return self._state.conversation.tool_names[message_id]

    def layout(self, counter: TokenCounter) -> TokenLayout:
        """The token layout of the whole payload as `counter` counts it (computed once per call)."""
        return self._state.count(counter).layout

    def tokens(self, counter: TokenCounter, message_ids: Iterable[int]) -> int:
        spans = self._state.count(counter).layout.spans
        return sum(spans[i][1] - spans[i][0] for i in message_ids)

    def prompt_tokens(self, counter: TokenCounter) -> int:
        """Tokens of messages up to `boundary` plus the generation prompt, nothing removed."""
        cache = self._state.count(counter)
        return cache.prefix[self.boundary + 1] + cache.layout.generation_tokens

    def visible_tokens(self, counter: TokenCounter) -> int:
        """Tokens the next query would read: `prompt_tokens` minus every hidden message."""
        cache = self._state.count(counter)
        return cache.prefix[self.boundary + 1] + cache.layout.generation_tokens - cache.hidden_tokens

    def position_length(self, counter: TokenCounter) -> int:
        """The next free position: `prompt_tokens` minus the tokens already compacted away."""
        cache = self._state.count(counter)
        return cache.prefix[self.boundary + 1] + cache.layout.generation_tokens - cache.compacted_tokens

    @property
    def uncompacted(self) -> tuple[int, ...]:
        """Hidden ids whose positions no reposition has compacted yet."""
        return tuple(self._state.hidden_order[self._state.compacted_count:])

    def model_requests(self, tool_name: str) -> tuple[ModelRequest, ...]:
        """Successful receipts of the drop tool `tool_name` at boundaries up to this one, in message order."""
        state = self._state
        found = state.requests.get(tool_name)
        if found is None:
            requests = find_model_requests(state.messages, state.conversation, tool_name)
            found = state.requests[tool_name] = (requests, [r.boundary for r in requests])
        requests, boundaries = found
        return requests[:bisect.bisect_right(boundaries, self.boundary)]

    def model_request_here(self, tool_name: str) -> bool:
        """True when this boundary's tool-call batch carries a successful `tool_name` receipt."""
        requests = self.model_requests(tool_name)
        return bool(requests) and requests[-1].boundary == self.boundary


def check_ids(ids: object, ctx: DecisionContext, rule: object) -> list[int]:
    """Validate a selector's output: ints, not after the boundary. Returns them in order, de-duplicated."""
    kind = type(ids)
    if kind is not list and kind is not tuple and (
            isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable)):
        raise RuleError(f"selector {rule!r} must return an iterable of message ids, got {type(ids).__name__}")
    boundary = ctx.boundary
    out = []
    for i in ids:
        if type(i) is not int or not 0 <= i <= boundary:
            raise RuleError(f"selector {rule!r} returned {i!r} at boundary {boundary}; ids must be ints in "
                            f"[0, {boundary}]")
        out.append(i)
    return sorted(set(out))
