"""Offline policy cost simulator: replays a method's requests through the cache core, as a server
with a radix cache would see them, and counts per call what is prefilled, read from cache,
re-rotated, skipped by drops and generated.

Every piece of text gets its own synthetic token ids (so identical pieces share KV and nothing
else does); a request's program is compiled from those ids, owners = message index and the
generation prompt owned by the reply, with the request's AKV rules; the cache core admits it and
is finished with the generated tokens that have KV (all but the last), so the tree carries over
between calls as on a server. Text methods are plain requests: the same core then behaves as
SGLang's prefix cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import dataclasses
from dataclasses import asdict, dataclass

import numpy as np

from akv.system.cache import ActiveRequest, CacheCore, CacheFull, SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules
from bench.agent_replay.methods import Method, Piece, Request
from bench.agent_replay.trajectories import Trajectory

DEFAULT_POOL_SLOTS = 1 << 23


@dataclass(frozen=True)
class PriceTable:
    """Dollars per million tokens. Re-rotated tokens are priced as cached input (as the reference
    did); tokens skipped by drops cost nothing. Default: the 10:1 input/cached ratio of current
    hosted APIs with prompt caching (1.25 / 0.125 / 10.0 $ per M, GPT-5 list prices)."""

    input: float = 1.25
    cached_input: float = 0.125
    output: float = 10.0

    def cost(self, prefilled: int, cache_read: int, generated: int) -> float:
        return (prefilled * self.input + cache_read * self.cached_input + generated * self.output) / 1e6


@dataclass(frozen=True)
class CallRow:
    """One request's counts. `prompt` = prefilled + cached + repos + the dropped tokens nothing
    computed or read; `skipped` counts every dropped prompt token (DESIGN.md §2: also those this
    request computed before its drop), so it overlaps `prefilled`; `live` is the number of KV entries the first generated token attends to; `pool_used` the KV slots the cache holds
    after the request (tree versions, re-rotated copies included)."""

    trajectory: str
    method: str
    turn: int
    kind: str
    prompt: int
    prefilled: int
    cached: int
    repos: int
    skipped: int
    generated: int
    live: int
    pool_used: int
    cost: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


COUNTS = ("prompt", "prefilled", "cached", "repos", "skipped", "generated")


class TokenIds:
    """Synthetic token ids: one fresh, contiguous range per distinct piece key."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], np.ndarray] = {}
        self._next = 0

    def of(self, piece: Piece) -> np.ndarray:
        ids = self._ids.get(piece.key)
        if ids is None:
            ids = self._ids[piece.key] = np.arange(self._next, self._next + piece.tokens, dtype=np.int64)
            self._next += piece.tokens
        elif ids.size != piece.tokens:
            raise ValueError(f"piece {piece.key}: {piece.tokens} tokens, but {ids.size} earlier")
        return ids


class LiveKvProtected(CacheFull):
    """A :class:`Simulator` with ``protect_live`` would have to evict KV a recorded path reads."""


@dataclass(frozen=True)
class Call:
    """A request admitted by a :class:`Simulator` and not finished yet: its counts, the generated
    tokens it publishes when it finishes (all but the last) and their slots, held from admission."""

    active: ActiveRequest
    row: CallRow
    published: np.ndarray
    decoded: np.ndarray


class Simulator:
    """One server's cache (a CacheCore over `pool_slots` slots) replaying requests in order;
    `in_place`: re-rotate resident KV in its own slots where nothing else reads it, as the patched
    server does (False: every re-rotation is a copy, as it did before in-place re-rotation);
    `protect_live`: while other requests are in flight, a request waits (:meth:`admit` raises
    :class:`LiveKvProtected`) rather than evict KV that a recorded path still reads (the tree's
    dropped and stale versions go first, as always): an admission policy the patched server does not
    have, to see what it would change."""

    def __init__(self, prices: PriceTable = PriceTable(), pool_slots: int = DEFAULT_POOL_SLOTS,
                 in_place: bool = False, protect_live: bool = False) -> None:
        self.prices = prices
        self.core = CacheCore(SlotPool(pool_slots))
        self.in_place = in_place
        self.protect_live = protect_live
        self._ids: dict[str, TokenIds] = {}

    def run(self, request: Request, generation_tokens: int, trajectory: str = "", method: str = "",
            token_ids: np.ndarray | None = None) -> CallRow:
        """One request. `token_ids`: the prompt's real token ids (the pieces, then the generation
        prompt) instead of synthetic ones, to account for exactly what a server was sent; generated
        tokens stay synthetic, so give real ids for every request of a Simulator or for none."""
        call = self.admit(request, generation_tokens, trajectory, method, token_ids)
        self.finish(call)
        return dataclasses.replace(call.row, pool_used=self.pool_used)

    @property
    def pool_used(self) -> int:
        return self.core.pool.size - self.core.pool.n_free

    def admit(self, request: Request, generation_tokens: int, trajectory: str = "", method: str = "",
              token_ids: np.ndarray | None = None, namespace: str = "") -> Call:
        """Admit one request (:meth:`run`'s arguments; `namespace` keeps conversations that share
        synthetic ids apart); raises :class:`~akv.system.cache.CacheFull` holding nothing when the pool
        cannot take it now."""
        pieces = request.pieces
        n = len(pieces)
        ids = self._ids.setdefault(namespace, TokenIds())
        reply = ids.of(request.reply)
        n_prompt = sum(p.tokens for p in pieces) + generation_tokens
        if token_ids is None:
            token_ids = np.concatenate([ids.of(p) for p in pieces] + [reply[:generation_tokens]])
        elif len(token_ids) != n_prompt:
            raise ValueError(f"token_ids: {len(token_ids)} ids for a prompt of {n_prompt} tokens")
        token_ids = np.asarray(token_ids, dtype=np.int64)
        owners = np.repeat(np.arange(n + 1, dtype=np.int64), [p.tokens for p in pieces] + [generation_tokens])
        rules = parse_rules(request.drop_message, request.reposition, n)
        program = compile_program(token_ids, owners, rules, n)
        published = reply[generation_tokens:generation_tokens + request.generated][:-1]
        draft = self.core.match(program, namespace, in_place=self.in_place)
        need = draft.n_births + draft.n_copy_slots + published.size
        if self.protect_live and self.core.active and need > self.core.pool.n_free + self.spare_slots():
            raise LiveKvProtected(f"needs {need} slots: more than the free and the unread ones")
        active = self.core.admit_draft(draft)
        try:
            decoded = self.core.allocate(published.size)  # the KV its decode writes, held while in flight
        except CacheFull:
            self.core.abort(active)
            raise
        plan = active.plan
        usage = plan.usage
        prefilled = int(np.count_nonzero(plan.computed[:program.n_prompt]))
        read = usage.cached_tokens + usage.repos_tokens
        row = CallRow(trajectory, method, request.turn, request.kind, program.n_prompt, prefilled,
                      usage.cached_tokens, usage.repos_tokens, usage.drop_skipped_tokens, request.generated,
                      int(plan.terminal.tokens.size), self.pool_used,
                      self.prices.cost(prefilled, read, request.generated))
        return Call(active, row, published, decoded)

    def spare_slots(self) -> int:
        """Slots eviction can free without touching KV a recorded path reads: the tree's dropped and
        stale versions that no request references (what the patched server's ``--akv-protect-live``
        admission counts, :meth:`akv.system.cache.tree.RadixTree.n_spare`)."""
        return self.core.tree.n_spare()

    def finish(self, call: Call) -> None:
        """Publish the call's prompt and generated KV (all but the last generated token) and release it."""
        self.core.finish(call.active, call.published, call.decoded)


def simulate(trajectory: Trajectory, method: Method, prices: PriceTable = PriceTable(),
             pool_slots: int = DEFAULT_POOL_SLOTS) -> list[CallRow]:
    """Replay one trajectory through one method on a fresh cache."""
    sim = Simulator(prices, pool_slots)
    return [sim.run(r, trajectory.generation_tokens, trajectory.name, method.name) for r in method.requests(trajectory)]


@dataclass(frozen=True)
class SharedRun:
    """What :func:`simulate_shared` counted: the rows of the requests after each conversation's first,
    how often a request waited for another to finish, and the conversations refused outright."""

    rows: list[CallRow]
    waits: int
    refused: list[str]
    peak_pool_used: int


def simulate_shared(trajectories: Sequence[Trajectory], method: Method, concurrency: int, pool_slots: int,
                    start_turn: int = 0, in_place: bool = True, prices: PriceTable = PriceTable(),
                    protect_live: bool = False) -> SharedRun:
    """`concurrency` conversations on one cache of `pool_slots` slots, as the replay suite runs them:
    conversation k replays trajectory k mod len(trajectories) from `start_turn` (its first request
    prefills that turn cold and is not counted, as the suite primes), each in its own namespace (no
    shared prefix, as the suite's tags make it). Requests go round robin, one per conversation, and
    each stays in flight (admitted, holding its KV) until its conversation's next request: the pool
    holds `concurrency` requests at once. A request the pool cannot take waits for the oldest one in
    flight to finish (counted in `waits`); one that cannot be taken with nothing else in flight is
    refused. The run ends when the first conversation runs out of requests, so every counted round
    has all `concurrency` in flight. `protect_live`: :class:`Simulator`'s."""
    sim = Simulator(prices, pool_slots, in_place, protect_live)
    lanes = []
    for k in range(concurrency):
        t = trajectories[k % len(trajectories)]
        lanes.append((f"{t.name}#{k}", t, [r for r in method.requests(t) if r.turn >= start_turn]))
    flight: dict[int, Call] = {}  # conversation -> its request in flight, oldest first
    rows: list[CallRow] = []
    waits, refused, peak = 0, [], 0
    for step in range(min(len(requests) for _, _, requests in lanes)):
        for k, (name, t, requests) in enumerate(lanes):
            if name in refused:
                continue
            if k in flight:
                sim.finish(flight.pop(k))
            call, waited = _admit_or_wait(sim, flight, requests[step], t.generation_tokens, name, method.name)
            waits += waited
            if call is None:
                refused.append(name)
                continue
            flight[k] = call
            peak = max(peak, sim.pool_used)
            if step:
                rows.append(call.row)
    for call in flight.values():
        sim.finish(call)
    return SharedRun(rows, waits, refused, peak)


def _admit_or_wait(sim: Simulator, flight: dict[int, Call], request: Request, generation_tokens: int,
                   conversation: str, method: str) -> tuple[Call | None, int]:
    """Admit `request`, finishing the oldest request in `flight` each time the pool cannot take it;
    the call (None: not even with nothing in flight) and how many times it waited."""
    waits = 0
    while True:
        try:
            return sim.admit(request, generation_tokens, conversation, method, namespace=conversation), waits
        except CacheFull:
            if not flight:
                return None, waits
            sim.finish(flight.pop(next(iter(flight))))
            waits += 1


def totals(rows: Iterable[CallRow], prices: PriceTable) -> dict[str, float | int]:
    """Summed counts, cost, and the cost shares of prefill, cache reads (cached + re-rotated) and output."""
    rows = list(rows)
    out: dict[str, float | int] = {k: sum(getattr(r, k) for r in rows) for k in COUNTS}
    out["calls"] = len(rows)
    out["summary_calls"] = sum(r.kind == "summary" for r in rows)
    out["max_prompt"] = max((r.prompt for r in rows), default=0)
    out["max_live"] = max((r.live for r in rows), default=0)
    out["max_pool_used"] = max((r.pool_used for r in rows), default=0)
    prefill = prices.cost(int(out["prefilled"]), 0, 0)
    read = prices.cost(0, int(out["cached"]) + int(out["repos"]), 0)
    output = prices.cost(0, 0, int(out["generated"]))
    cost = prefill + read + output
    out["cost"] = cost
    for name, part in (("prefill", prefill), ("cache_read", read), ("output", output)):
        out[f"{name}_share"] = part / cost if cost else 0.0
    return out


Progress = Callable[[str], None]


def run_all(trajectories: Iterable[Trajectory], methods: Iterable[Method], prices: PriceTable = PriceTable(),
            pool_slots: int = DEFAULT_POOL_SLOTS, progress: Progress | None = None) -> list[CallRow]:
    rows: list[CallRow] = []
    methods = list(methods)
    for t in trajectories:
        for m in methods:
            got = simulate(t, m, prices, pool_slots)
            rows.extend(got)
            if progress is not None:
                total = totals(got, prices)
                progress(f"{t.name:>12} {m.name:>18}: {total['calls']:4d} calls, {total['prefilled']:>10,} prefilled, "
                         f"{total['cached'] + total['repos']:>12,} read, ${total['cost']:.3f}")
    return rows
