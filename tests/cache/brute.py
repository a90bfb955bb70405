"""Brute-force model of what every query reads, and a simulated KV store that checks plans against it.

The brute force uses only token ids and each event's kind, ``at`` and drop ranges: it walks the
tokens one at a time, applies events when reached, and names a token's KV by everything it depends
on: ``(token id, birth position, ((name, position) of each key it read), ...)``, interned so equal
histories get equal names. A slot's content is modelled as the pair (name, rotation position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from akv.system.cache.plan import CopyJob, RequestPlan
from akv.system.cache.pool import SlotPool
from akv.system.context.program import ContextProgram, EventKind

Label = tuple[int, int]


class Interner:
    """Gives equal KV histories equal small ids, across every program of a test."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def __call__(self, history: tuple) -> int:
        return self._ids.setdefault(history, len(self._ids))


@dataclass(frozen=True)
class BruteLayout:
    """Per token: KV name, birth position, and the exact labels its query reads (itself included);
    ``terminal``: labels generation reads (kept tokens at their final positions)."""

    names: tuple[int, ...]
    birth: tuple[int, ...]
    reads: tuple[frozenset[Label], ...]
    terminal: dict[int, Label]


def brute_layout(program: ContextProgram, intern: Interner) -> BruteLayout:
    n = program.n_tokens
    pending = sorted(program.events, key=lambda e: e.at)
    hidden: set[int] = set()
    position: dict[int, int] = {}
    names: list[int] = []
    birth: list[int] = []
    reads: list[frozenset[Label]] = []
    next_position = 0
    for t in range(n + 1):
        while pending and pending[0].at == t:
            event = pending.pop(0)
            if event.kind == EventKind.DROP:
                hidden.update(s for a, b in event.ranges for s in range(a, b))
            else:
                survivors = [s for s in range(t) if s not in hidden]
                position.update((s, i) for i, s in enumerate(survivors))
                next_position = len(survivors)
        if t == n:
            break
        seen = tuple((names[s], position[s]) for s in range(t) if s not in hidden)
        position[t] = next_position
        names.append(intern((int(program.token_ids[t]), next_position, seen)))
        birth.append(next_position)
        reads.append(frozenset(seen) | {(names[t], next_position)})
        next_position += 1
    terminal = {s: (names[s], position[s]) for s in range(n) if s not in hidden}
    return BruteLayout(tuple(names), tuple(birth), tuple(reads), terminal)


@dataclass
class Trace:
    """What executing one plan did: tokens computed, and per token the slots it was read from."""

    computed: set[int] = field(default_factory=set)
    read_from: dict[int, set[int]] = field(default_factory=dict)
    written: set[int] = field(default_factory=set)


class SimulatedKV:
    """Slot contents as labels; freed slots forget theirs (the pool's ``on_free`` hook)."""

    def __init__(self) -> None:
        self.content: dict[int, Label] = {}

    def forget(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            self.content.pop(s, None)

    def execute(self, plan: RequestPlan, brute: BruteLayout, pool: SlotPool, rewritable: set[int] = frozenset()) -> Trace:
        """Run ``plan`` against the brute force, asserting every read and write (``rewritable``: tree
        slots the plan rotates in place)."""
        trace = Trace()
        private = set(plan.fresh.tolist()) | set(rewritable)
        for segment in plan.segments:
            self._copy(segment.copies, brute, pool, trace, private)
            assert segment.positions.tolist() == list(brute.birth[segment.start : segment.end])
            indptr, indices = segment.visible_slots()
            for i, q in enumerate(range(segment.start, segment.end)):
                self._write(int(segment.slots[i]), (brute.names[q], brute.birth[q]), pool, trace, private)
                trace.computed.add(q)
                row = indices[indptr[i] : indptr[i + 1]].tolist()
                labels = [self._read(s, pool) for s in row]
                assert len(labels) == len(set(labels)) == len(brute.reads[q]), f"query {q} reads {labels}"
                assert set(labels) == brute.reads[q], f"query {q}: read {sorted(labels)}, expected {sorted(brute.reads[q])}"
                tokens = segment.prefix_tokens.tolist() + list(range(segment.start, q + 1))
                self._note_reads(tokens, row, labels, brute, trace)
        self._copy(plan.terminal.copies, brute, pool, trace, private)
        slots = plan.terminal.slots.tolist()
        labels = [self._read(s, pool) for s in slots]
        assert dict(zip(plan.terminal.tokens.tolist(), labels)) == brute.terminal
        self._note_reads(plan.terminal.tokens.tolist(), slots, labels, brute, trace)
        return trace

    def write_generated(self, slots: np.ndarray, brute: BruteLayout, first: int, pool: SlotPool) -> None:
        for j, slot in enumerate(slots.tolist()):
            t = first + j
            self._write(slot, (brute.names[t], brute.birth[t]), pool, Trace(), set())

    def _copy(self, job: CopyJob, brute: BruteLayout, pool: SlotPool, trace: Trace, private: set[int]) -> None:
        for token, src, dst, old, new in zip(job.tokens.tolist(), job.src.tolist(), job.dst.tolist(),
                                             job.old_positions.tolist(), job.new_positions.tolist()):
            assert self._read(src, pool) == (brute.names[token], old), f"copy source {src} of token {token}"
            self._write(dst, (brute.names[token], new), pool, trace, private)

    def _read(self, slot: int, pool: SlotPool) -> Label:
        assert pool.refcount([slot])[0] > 0, f"read of free slot {slot}"
        assert slot in self.content, f"read of slot {slot} before anything was written to it"
        return self.content[slot]

    def _write(self, slot: int, label: Label, pool: SlotPool, trace: Trace, private: set[int]) -> None:
        """A slot is written once, except that a plan may recycle its own private slots."""
        if slot not in private:
            assert slot not in self.content, f"slot {slot} rewritten while allocated (held {self.content[slot]})"
        assert pool.refcount([slot])[0] == 1, f"slot {slot} written while shared"
        self.content[slot] = label
        trace.written.add(slot)

    @staticmethod
    def _note_reads(tokens: list[int], slots: list[int], labels: list[Label], brute: BruteLayout, trace: Trace) -> None:
        assert len(tokens) == len(slots)
        for token, slot, (name, _) in zip(tokens, slots, labels):
            assert name == brute.names[token], f"slot {slot} listed for token {token} holds another token's KV"
            trace.read_from.setdefault(token, set()).add(slot)



def brute_reads(program: ContextProgram) -> tuple[list[list[int]], set[int]]:
    """Per token, the earlier tokens its query reads, and the tokens hidden at the end (dropped by
    some event); from the events alone, as :func:`brute_layout` walks them."""
    n = program.n_tokens
    pending = sorted(program.events, key=lambda e: e.at)
    hidden: set[int] = set()
    reads: list[list[int]] = []
    for t in range(n + 1):
        while pending and pending[0].at == t:
            event = pending.pop(0)
            if event.kind == EventKind.DROP:
                hidden.update(s for a, b in event.ranges for s in range(a, b))
        if t < n:
            reads.append([s for s in range(t) if s not in hidden])
    return reads, hidden


def brute_needed(program: ContextProgram) -> int:
    """How many tokens an empty cache must compute for ``program``: the last one (its logits), those
    generation reads, and every token a query that runs reads (walked back from the end)."""
    n = program.n_tokens
    reads, hidden = brute_reads(program)
    needed = {s for s in range(n) if s not in hidden} | {n - 1}
    for t in range(n - 1, -1, -1):
        if t in needed:
            needed.update(reads[t])
    return len(needed)
