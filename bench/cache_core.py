"""Cache core throughput on CPU: a tree holding ~1M tokens from 1,000 synthetic agent conversations.

Measured in one run: building the tree turn by turn through the core (match + plan + allocate +
publish); match and insert throughput on the full tree (insert = republishing a request's resident
path, what every finished turn does); planning time per request for each conversation's next turn;
admission time for one long (32k-token) agent context, cold and warm, and the engine path's
``match`` (key, tree match, plan: what SGLang's scheduler thread pays per scheduling attempt until
the tree changes) and ``commit`` (at lock time).

    python bench/cache_core.py --out bench/results/cache_core.json

``--long-only`` measures the long context alone (on a tree holding only it); ``--clock cpu`` times with
the process's CPU time instead of wall time (steadier on a shared machine).

``--next-turn STEPS ...`` measures instead the scheduler's host work for the next turn of
bench/next_turn.py (issue #29), per size: a conversation of STEPS tool calls with results of about
1,000 tokens (29: ~30k tokens, 113: ~114k) is served as a plain turn, then its next turn (one more
call and result) drops the first half of the results and repositions at the new message, through the
adapter's request state (:class:`akv.system.adapter.context_request.AkvRequest`) on a tree holding
only that turn, phase by phase: ``match_plan`` (key, tree match, plan), ``lock_commit``,
``rounds`` (the one prefill round's prefix view, visibility row, birth binding, attention entries
and copy jobs, as :func:`akv.system.adapter.batch_metadata.for_extend` builds them on the host), and
``publish`` (the finished request's KV into the tree). A fresh system message per trial, as there.

``--agent TURNS`` measures instead one live-budget agent served turn by turn on one tree (issue #30's
shape, what the browse replay with a live budget does): every turn appends a call (60 tokens) and a
tool result (about 2,300), and once the live tokens pass ``--live-budget`` (20k) the turn drops the
oldest kept results until it fits again and repositions there, so the text grows without bound
(110 turns: ~260k tokens, 200+ events) while the live part stays under the budget. Each turn goes
through the adapter's request state as ``--next-turn`` does (match_plan, lock_commit, rounds,
publish; the reply's one generated token is the next call's first), on a pool of ``--agent-pool``
slots, so SGLang's allocation evicts through the tree (``evict``: its share, also inside
lock_commit and rounds). Reported per turn, with the text and live length and the events.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli  # noqa: E402
from akv.system.cache.core import CacheCore  # noqa: E402
from akv.system.cache.keys import program_key  # noqa: E402
from akv.system.cache.occurrence import plan_occurrences  # noqa: E402
from akv.system.cache.pool import SlotPool  # noqa: E402
from akv.system.context.compiler import compile_program  # noqa: E402
from akv.system.context.program import ContextProgram  # noqa: E402
from akv.system.context.rules import parse_rules  # noqa: E402
from bench.harness import results  # noqa: E402

VOCAB = 150_000


@dataclass(frozen=True)
class Conversation:
    """Token lists per message plus the agent's drop/reposition decisions, as sent on the wire."""

    messages: list[np.ndarray]
    drops: dict[int, list[int]]
    repositions: list[int]

    def program(self, turn: int) -> ContextProgram:
        ids = np.concatenate(self.messages[: turn + 1])
        owners = np.repeat(np.arange(turn + 1), [m.size for m in self.messages[: turn + 1]])
        drops = {str(a): ms for a, ms in self.drops.items() if a <= turn} or None
        repositions = [r for r in self.repositions if r <= turn] or None
        return compile_program(ids, owners, parse_rules(drops, repositions, turn + 1), turn + 1)


def make_conversation(rng: np.random.Generator, system: np.ndarray, n_messages: int, mean_len: int) -> Conversation:
    """Shared system prompt, then user/assistant/tool messages; every 4th message the agent drops an
    old tool result, every 8th it also repositions."""
    messages = [system] + [rng.integers(0, VOCAB, size=int(rng.integers(mean_len // 2, mean_len * 3 // 2)))
                           for _ in range(n_messages - 1)]
    drops: dict[int, list[int]] = {}
    repositions: list[int] = []
    dropped: set[int] = set()
    for anchor in range(4, n_messages, 4):
        candidates = [m for m in range(1, anchor - 1) if m not in dropped]
        if candidates:
            victim = int(rng.choice(candidates))
            drops[anchor] = [victim]
            dropped.add(victim)
        if anchor % 8 == 0:
            repositions.append(anchor)
    return Conversation(messages, drops, repositions)


CLOCK = time.perf_counter


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = CLOCK()
    out = fn(*args)
    return out, CLOCK() - start


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p95_ms": round(float(np.percentile(ms, 95)), 3),
            "mean_ms": round(float(ms.mean()), 3)}


def full_tree(core: CacheCore, convs: list[Conversation], args: argparse.Namespace) -> dict[str, Any]:
    """Build the tree turn by turn, then time match, insert and next-turn planning on it."""
    build_tokens, build_seconds = 0, 0.0
    for conv in convs:
        for turn in range(args.messages - 1):
            program = conv.program(turn)
            start = CLOCK()
            request = core.admit(program)
            core.finish(request)
            build_seconds += CLOCK() - start
            build_tokens += program.n_tokens
    tree_stats = core.tree.stats()

    keys = [core.admit(c.program(args.messages - 2)) for c in convs]
    for request in keys:
        core.finish(request)
    match_seconds, matched = 0.0, 0
    for request in keys:
        result, seconds = timed(core.tree.match, request.key)
        match_seconds += seconds
        matched += result.n_tokens
    insert_seconds, inserted = 0.0, 0
    for request in keys:
        found = core.tree.match(request.key)
        terminal = np.asarray(request.program.final_position)
        _, seconds = timed(core.tree.insert, request.key, found.slots, found.positions, terminal)
        insert_seconds += seconds
        inserted += request.key.n_tokens

    plan_times, admit_times, prompt_tokens, computed_tokens = [], [], [], []
    for conv in convs:
        program = conv.program(args.messages - 1)
        match = core.tree.match(program_key(program))
        _, seconds = timed(plan_occurrences, program, match)
        plan_times.append(seconds)
        request, seconds = timed(core.admit, program)
        admit_times.append(seconds)
        prompt_tokens.append(program.n_tokens)
        computed_tokens.append(int(request.plan.computed.sum()))
        core.abort(request)

    return {
        "tree": {"conversations": len(convs), **tree_stats},
        "build_turn_by_turn": {"requests": len(convs) * (args.messages - 1), "prompt_tokens": build_tokens,
                               "seconds": round(build_seconds, 3),
                               "prompt_tokens_per_s": round(build_tokens / build_seconds)},
        "match_full_tree": {"requests": len(keys), "matched_tokens": matched, "seconds": round(match_seconds, 4),
                            "tokens_per_s": round(matched / match_seconds)},
        "insert_full_tree_republish": {"requests": len(keys), "tokens": inserted, "seconds": round(insert_seconds, 4),
                                        "tokens_per_s": round(inserted / insert_seconds)},
        "plan_next_turn": {"mean_prompt_tokens": round(float(np.mean(prompt_tokens)), 1),
                           "mean_computed_tokens": round(float(np.mean(computed_tokens)), 1),
                           "plan_occurrences": percentiles(plan_times), "admit": percentiles(admit_times)},
    }


def long_context(core: CacheCore, rng: np.random.Generator, system: np.ndarray,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Admission of one long agent context: its first turn cold, then its next turn warm."""
    long_conv = make_conversation(rng, system, max(4, args.long_tokens // args.mean_len), args.mean_len)
    long_first = long_conv.program(len(long_conv.messages) - 2)
    long_next = long_conv.program(len(long_conv.messages) - 1)
    cold, cold_seconds = timed(core.admit, long_first)
    core.finish(cold)
    warm_times, match_times, commit_times = [], [], []
    for _ in range(args.repeats):
        request, seconds = timed(core.admit, long_next)
        warm_times.append(seconds)
        core.abort(request)
        draft, seconds = timed(core.match, long_next)
        match_times.append(seconds)
        request, seconds = timed(core.commit, draft)
        commit_times.append(seconds)
        core.abort(request)

    return {"prompt_tokens": long_next.n_tokens, "events": len(long_next.events),
            "cold_admit_ms": round(cold_seconds * 1e3, 2), "warm_admit": percentiles(warm_times),
            "warm_match_plan": percentiles(match_times), "warm_commit": percentiles(commit_times)}


NEXT_TURN_SIZES = {"system": 60, "user": 40, "call": 60, "result": 940, "reply": 3}
"""Tokens per message of the next-turn conversation (the reply: the generation prompt after the events)."""


def next_turn_program(rng: np.random.Generator, steps: int) -> tuple[np.ndarray, ContextProgram]:
    """The turn's token ids (system, user, ``steps`` calls and results) and its next turn's program."""
    n = NEXT_TURN_SIZES
    sizes = [n["system"], n["user"]] + [n["call"], n["result"]] * (steps + 1) + [n["reply"]]
    ids = rng.integers(0, VOCAB, size=sum(sizes))
    owners = np.repeat(np.arange(len(sizes)), sizes)
    anchor = len(sizes) - 2
    results = list(range(3, anchor - 1, 2))
    rules = parse_rules({str(anchor): results[: len(results) // 2]}, [anchor], anchor + 1)
    return ids[: -sum(sizes[-3:])], compile_program(ids, owners, rules, anchor + 1)


def next_turn(core: CacheCore, rng: np.random.Generator, steps: int, repeats: int) -> dict[str, Any]:
    """The phases of the next turn's host work (module docstring), ``repeats`` trials after one unmeasured."""
    from akv.system.adapter.context_request import AkvRequest
    from akv.system.adapter.extend_entries import EntryLists, add_layer_jobs, context_round
    from akv.system.cache import plain

    free = core.pool._free_list  # the engine allocates births off the free list, as SGLang's allocator does
    phases: dict[str, list[float]] = {k: [] for k in ("match_plan", "lock_commit", "rounds", "publish", "total")}
    shape: dict[str, Any] = {}
    for trial in range(repeats + 1):
        core.flush()
        turn, program = next_turn_program(rng, steps)
        own = free.take(turn.size)
        plain.publish(core, own, 0, turn, "")
        state = AkvRequest(program)
        times = {}
        start = CLOCK()
        state.plan_draft(core, room=core.pool.size)
        times["match_plan"] = CLOCK() - start
        start = CLOCK()
        state.lock(core)
        state.commit(core)
        times["lock_commit"] = CLOCK() - start
        lo, hi = state.first_start, program.n_tokens
        births = free.take(hi - lo)
        start = CLOCK()
        state.prefix_view(lo)
        state.visibility_row(262_144)  # bench/next_turn.py's context length
        state.bind(core, lo, births)
        entries, levels = EntryLists(), []
        add_layer_jobs(levels, context_round(entries, state, lo, hi)[1])
        entries.build("cpu")
        times["rounds"] = CLOCK() - start
        n_segments = len(state.plan_segments)
        generated = free.take(1)
        core.pool.adopt(generated)
        start = CLOCK()
        state.release(core, np.asarray([7]), generated, publish=True)
        times["publish"] = CLOCK() - start
        times["total"] = sum(times.values())
        if trial:
            for name, seconds in times.items():
                phases[name].append(seconds)
        usage = state.first_usage
        shape = {"prompt_tokens": program.n_tokens, "cached_tokens": usage.cached_tokens,
                 "repositioned_tokens": usage.repos_tokens, "computed_tokens": usage.computed_tokens,
                 "segments": n_segments}
    return {**shape, **{name: percentiles(seconds) for name, seconds in phases.items()}}


AGENT_SIZES = {"system": 60, "user": 40, "call": 60, "result": 2300}
"""Tokens per message of the live-budget agent (results vary by +-20%)."""


def agent_messages(rng: np.random.Generator, turns: int) -> list[np.ndarray]:
    """System, user, then ``turns`` (call, result) pairs, and one more call (the last reply's text)."""
    n = AGENT_SIZES
    sizes = [n["system"], n["user"]]
    for _ in range(turns):
        sizes += [n["call"], int(rng.integers(n["result"] * 4 // 5, n["result"] * 6 // 5))]
    sizes.append(n["call"])
    return [rng.integers(0, VOCAB, size=size) for size in sizes]


@dataclass(frozen=True)
class AgentTurn:
    """One turn of the live-budget agent: its request holds messages ``0..last`` (``ids`` with their
    ``owners``), the drops and repositions so far as sent on the wire, and ``live`` tokens once the
    ``dropped`` messages are gone."""

    last: int
    ids: np.ndarray
    owners: np.ndarray
    drops: dict[str, list[int]]
    repositions: list[int]
    dropped: frozenset[int]
    live: int


def agent_turns(messages: list[np.ndarray], budget: int) -> Iterator[AgentTurn]:
    """The live-budget agent's turns over :func:`agent_messages`' ``messages``: turn ``k`` ends with
    tool result ``3 + 2k``; once the live length passes ``budget`` it drops the oldest results until
    it fits and repositions at the new result."""
    sizes = [m.size for m in messages]
    drops: dict[str, list[int]] = {}
    repositions: list[int] = []
    dropped: set[int] = set()
    for turn in range((len(messages) - 3) // 2):
        last = 3 + 2 * turn  # this turn's tool result
        live = sum(sizes[m] for m in range(last + 1) if m not in dropped)
        victims = []
        for m in range(3, last, 2):
            if live <= budget:
                break
            if m not in dropped:
                victims.append(m)
                live -= sizes[m]
        if victims:
            drops[str(last)] = victims
            dropped.update(victims)
            repositions.append(last)
        yield AgentTurn(last, np.concatenate(messages[: last + 1]), np.repeat(np.arange(last + 1), sizes[: last + 1]),
                        {k: list(v) for k, v in drops.items()}, list(repositions), frozenset(dropped), live)


def agent(rng: np.random.Generator, turns: int, budget: int, pool_size: int) -> dict[str, Any]:
    """The live-budget agent's turns (module docstring), each timed phase by phase."""
    from akv.system.adapter.context_request import AkvRequest
    from akv.system.adapter.extend_entries import EntryLists, add_layer_jobs, context_round
    from akv.system.adapter.scheduling import ADMISSION_SLACK

    evict_seconds = [0.0]

    def evict(n: int) -> None:
        start = CLOCK()
        core.tree.evict(n - core.pool.n_free)
        evict_seconds[0] += CLOCK() - start

    core = CacheCore(SlotPool(pool_size), evict=evict)
    free = core.pool._free_list

    def take(n: int) -> np.ndarray:  # SGLang's allocator: evict through the tree when short
        if n > core.pool.n_free:
            core._evict(n)
        return free.take(n)

    messages = agent_messages(rng, turns)
    rows = []
    for turn, step in enumerate(agent_turns(messages, budget)):
        last, drops, repositions = step.last, step.drops, step.repositions
        program = compile_program(step.ids, step.owners, parse_rules(drops or None, repositions or None, last + 1),
                                  last + 1)
        state = AkvRequest(program)
        evict_seconds[0] = 0.0
        times = {}
        start = CLOCK()
        state.plan_draft(core, room=core.pool.size - program.n_tokens - ADMISSION_SLACK)  # as scheduling.attach
        times["match_plan"] = CLOCK() - start
        start = CLOCK()
        state.lock(core)
        state.commit(core)
        times["lock_commit"] = CLOCK() - start
        assert state.active is not None
        lo, n = state.first_start, program.n_tokens
        computed = lo + np.flatnonzero(state.active.plan.computed[lo:])
        births = take(computed.size)
        start = CLOCK()
        state.prefix_view(lo)
        state.visibility_row(n + 1)  # the columns it reads
        core.bind_births(state.active, computed, births)
        entries, levels = EntryLists(), []
        add_layer_jobs(levels, context_round(entries, state, lo, n)[1])
        entries.build("cpu")
        times["rounds"] = CLOCK() - start
        generated = take(1)
        core.pool.adopt(generated)
        start = CLOCK()
        state.release(core, messages[last + 1][:1], generated, publish=True)
        times["publish"] = CLOCK() - start
        times["evict"] = evict_seconds[0]
        times["total"] = sum(v for k, v in times.items() if k != "evict")
        usage = state.first_usage
        rows.append({"turn": turn, "text_tokens": n, "live_tokens": int(np.count_nonzero(program.keep)),
                     "events": len(program.events), "computed_tokens": usage.computed_tokens,
                     "repositioned_tokens": usage.repos_tokens,
                     **{f"{k}_ms": round(v * 1e3, 3) for k, v in times.items()}})
    return {"turns": rows, "by_text": agent_summary(rows), "tree": core.tree.stats()}


def agent_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median phase times per 50k-token band of text (turns past the first band only)."""
    out = []
    for lo in range(0, max(r["text_tokens"] for r in rows) + 1, 50_000):
        band = [r for r in rows if lo <= r["text_tokens"] < lo + 50_000]
        if band:
            out.append({"text_from": lo, "turns": len(band), **{
                k: round(float(np.median([r[k] for r in band])), 3)
                for k in band[0] if k.endswith("_ms")}})
    return out


def main() -> None:
    parser = cli.parser(None, __doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=12)
    parser.add_argument("--mean-len", type=int, default=100)
    parser.add_argument("--system-len", type=int, default=200)
    parser.add_argument("--long-tokens", type=int, default=32_768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-only", action="store_true")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--repeats", type=int, default=5, help="warm long-context admissions (or next turns) timed")
    parser.add_argument("--next-turn", type=int, nargs="+", default=None, metavar="STEPS",
                        help="measure bench/next_turn.py's next turn of these sizes instead (module docstring)")
    parser.add_argument("--agent", type=int, default=None, metavar="TURNS",
                        help="measure the live-budget agent of this many turns instead (module docstring)")
    parser.add_argument("--live-budget", type=int, default=20_000)
    parser.add_argument("--agent-pool", type=int, default=400_000, help="pool slots of --agent")
    parser.add_argument("--out", type=cli.new_file, default=None, help="also write the result to this new file")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    head = results.header("bench/cache_core.py")  # before the work: the load average at the start
    rng = np.random.default_rng(args.seed)
    if args.agent:
        results.show({**head, "clock": args.clock, "live_budget": args.live_budget, "pool": args.agent_pool,
                      "agent": agent(rng, args.agent, args.live_budget, args.agent_pool)}, args.out)
        return
    if args.next_turn:
        core = CacheCore(SlotPool(3 * 130_000 * max(args.next_turn) // 113 + 100_000))
        results.show({**head, "clock": args.clock, "next_turn": {
            str(steps): next_turn(core, rng, steps, args.repeats) for steps in args.next_turn}}, args.out)
        return
    system = rng.integers(0, VOCAB, size=args.system_len)
    convs = [make_conversation(rng, system, args.messages, args.mean_len) for _ in range(args.conversations)]
    total = sum(c.program(args.messages - 2).n_tokens for c in convs)
    pool = SlotPool(int(total * 2.5) + 100_000)
    core = CacheCore(pool)

    parts = {} if args.long_only else full_tree(core, convs, args)
    result = {
        **head,
        **parts,
        "long_context": long_context(core, rng, system, args),
    }
    results.show(result, args.out)


if __name__ == "__main__":
    main()
