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

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from akv.system.cache import CacheCore, SlotPool
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


class Simulator:
    """One server's cache (a CacheCore over `pool_slots` slots) replaying requests in order."""

    def __init__(self, prices: PriceTable = PriceTable(), pool_slots: int = DEFAULT_POOL_SLOTS) -> None:
        self.prices = prices
        self.core = CacheCore(SlotPool(pool_slots))
        self.ids = TokenIds()

    def run(self, request: Request, generation_tokens: int, trajectory: str = "", method: str = "",
            token_ids: np.ndarray | None = None) -> CallRow:
        """One request. `token_ids`: the prompt's real token ids (the pieces, then the generation
        prompt) instead of synthetic ones, to account for exactly what a server was sent; generated
        tokens stay synthetic, so give real ids for every request of a Simulator or for none."""
        pieces = request.pieces
        n = len(pieces)
        reply = self.ids.of(request.reply)
        n_prompt = sum(p.tokens for p in pieces) + generation_tokens
        if token_ids is None:
            token_ids = np.concatenate([self.ids.of(p) for p in pieces] + [reply[:generation_tokens]])
        elif len(token_ids) != n_prompt:
            raise ValueError(f"token_ids: {len(token_ids)} ids for a prompt of {n_prompt} tokens")
        token_ids = np.asarray(token_ids, dtype=np.int64)
        owners = np.repeat(np.arange(n + 1, dtype=np.int64), [p.tokens for p in pieces] + [generation_tokens])
        rules = parse_rules(request.drop_message, request.reposition, n)
        program = compile_program(token_ids, owners, rules, n)
        active = self.core.admit(program)
        plan = active.plan
        usage = plan.usage
        prefilled = int(np.count_nonzero(plan.computed[:program.n_prompt]))
        published = reply[generation_tokens:generation_tokens + request.generated][:-1]
        self.core.finish(active, published, self.core.allocate(published.size))
        read = usage.cached_tokens + usage.repos_tokens
        return CallRow(trajectory, method, request.turn, request.kind, program.n_prompt, prefilled,
                       usage.cached_tokens, usage.repos_tokens, usage.drop_skipped_tokens, request.generated,
                       int(plan.terminal.tokens.size), self.core.pool.size - self.core.pool.n_free,
                       self.prices.cost(prefilled, read, request.generated))


def simulate(trajectory: Trajectory, method: Method, prices: PriceTable = PriceTable(),
             pool_slots: int = DEFAULT_POOL_SLOTS) -> list[CallRow]:
    """Replay one trajectory through one method on a fresh cache."""
    sim = Simulator(prices, pool_slots)
    return [sim.run(r, trajectory.generation_tokens, trajectory.name, method.name) for r in method.requests(trajectory)]


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
