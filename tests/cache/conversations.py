"""Random multi-turn conversations with drops and repositions, and their per-turn programs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from akv.system.context.compiler import compile_program
from akv.system.context.program import ContextProgram
from akv.system.context.rules import parse_rules


@dataclass(frozen=True)
class Conversation:
    """Messages as token lists; ``drops[anchor]`` and ``repositions`` as sent on the wire."""

    messages: tuple[tuple[int, ...], ...]
    drops: dict[int, tuple[int, ...]]
    repositions: tuple[int, ...]

    @property
    def n_turns(self) -> int:
        return len(self.messages)

    def program(self, turn: int) -> ContextProgram:
        """The request after message ``turn``: messages ``0..turn`` and every op anchored there or earlier."""
        ids = [t for m in self.messages[: turn + 1] for t in m]
        owners = [i for i, m in enumerate(self.messages[: turn + 1]) for _ in m]
        drop_message = {str(a): list(ms) for a, ms in self.drops.items() if a <= turn} or None
        reposition = [r for r in self.repositions if r <= turn] or None
        rules = parse_rules(drop_message, reposition, turn + 1)
        return compile_program(np.array(ids, dtype=np.int64), np.array(owners, dtype=np.int64), rules, turn + 1)

    def without_ops_from(self, anchor: int) -> Conversation:
        """The same messages with only the ops anchored before ``anchor``: a branch that diverges from
        this history at ``anchor`` and so may need KV this one dropped."""
        drops = {a: ms for a, ms in self.drops.items() if a < anchor}
        return Conversation(self.messages, drops, tuple(r for r in self.repositions if r < anchor))

    def reply(self, turn: int) -> np.ndarray:
        """What the model "generates" after ``turn``: the next message, so the next turn extends it."""
        nxt = self.messages[turn + 1] if turn + 1 < self.n_turns else (0,)
        return np.array(nxt, dtype=np.int64)


@st.composite
def conversations(draw: st.DrawFn, vocab: int = 3, max_messages: int = 7, max_len: int = 4,
                  prefix: Conversation | None = None) -> Conversation:
    """A conversation; with ``prefix``, a branch of it: the first messages repeated, and the ops
    anchored at the first of them repeated too (possibly fewer, so identical text may get another
    history); later messages are drawn afresh or, half the time, copied again, and so are later ops."""
    n = draw(st.integers(2, max_messages))
    keep = draw(st.integers(0, min(n, prefix.n_turns))) if prefix is not None else 0
    keep_ops = draw(st.integers(0, keep))
    messages = list(prefix.messages[:keep]) if prefix is not None else []
    drops = {a: ms for a, ms in prefix.drops.items() if a < keep_ops} if prefix is not None else {}
    repositions = [r for r in prefix.repositions if r < keep_ops] if prefix is not None else []
    token = st.integers(0, vocab - 1)
    while len(messages) < n:
        i = len(messages)
        if prefix is not None and i < prefix.n_turns and draw(st.booleans()):
            messages.append(prefix.messages[i])
        else:
            messages.append(tuple(draw(st.lists(token, min_size=1, max_size=max_len))))
    dropped = {m for ms in drops.values() for m in ms}
    for anchor in range(keep_ops, n):
        candidates = [m for m in range(anchor + 1) if m not in dropped]
        if candidates and draw(st.booleans()):
            chosen = draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=2, unique=True))
            drops[anchor] = tuple(chosen)
            dropped.update(chosen)
        if draw(st.integers(0, 2)) == 0:
            repositions.append(anchor)
    return Conversation(tuple(messages), drops, tuple(repositions))
