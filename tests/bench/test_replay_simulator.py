"""The cost simulator: Full context and Standard equal closed-form sums worked by hand, the counts
always add up to the prompt, trimming re-prefills from the first edit, and AKV's decisions come
from akv.agent."""

from __future__ import annotations

import random

import pytest

from akv.agent import CachePolicy, TokenReposition, TokenSelection, TokenTrigger
from bench.agent_replay.methods import AKV, FullContext, Summarize, Trim, reference_policy
from akv.system.cache.tree import RadixTree
from bench.agent_replay import simulator as simulator_module
from bench.agent_replay.simulator import PriceTable, Simulator, simulate, simulate_shared, totals
from bench.agent_replay.trajectories import BROWSE, SWE, MessageSpec, Trajectory, generate

G = 3
# system 10, task 8; call 1 (9 tokens: 3 prompt + 5 generated + 1) -> one result of 20;
# call 2 (8 = 3 + 4 + 1) -> two results of 7 and 6; call 3 (10 = 3 + 6 + 1), the final answer.
WORKED = Trajectory("worked", (
    MessageSpec("system", 10), MessageSpec("user", 8),
    MessageSpec("assistant", 9, 5, 1), MessageSpec("tool", 20),
    MessageSpec("assistant", 8, 4, 2), MessageSpec("tool", 7), MessageSpec("tool", 6),
    MessageSpec("assistant", 10, 6),
), G)


def _counts(rows):
    return [(r.kind, r.prompt, r.prefilled, r.cached, r.generated) for r in rows]


def test_full_context_by_hand():
    rows = simulate(WORKED, FullContext())
    # call 2 reads call 1's prompt (21) and the 4 generated tokens that have KV (the last has none)
    assert _counts(rows) == [("turn", 21, 21, 0, 5), ("turn", 50, 25, 25, 4), ("turn", 71, 18, 53, 6)]
    prices = PriceTable(input=2.0, cached_input=0.5, output=8.0)
    total = totals(simulate(WORKED, FullContext(), prices), prices)
    assert total["cost"] == pytest.approx((64 * 2.0 + 78 * 0.5 + 15 * 8.0) / 1e6)


def test_standard_by_hand():
    method = Summarize(threshold=40, summary_tokens=4, instruction_tokens=2, summary_overhead=1)
    rows = simulate(WORKED, method)
    assert _counts(rows) == [
        ("turn", 21, 21, 0, 5),
        # 47 tokens of messages + 3 > 40: summarize (prompt + 2-token instruction), cached: system,
        # task and the 7 tokens of call 1's reply that have KV
        ("summary", 52, 27, 25, 4),
        # restart: system, task, summary (4 + 1): only system and task are cached
        ("turn", 26, 8, 18, 4),
        # 18 + 5 + 8 + 7 + 6 + 3 = 47 > 40 again: the summary call reuses everything up to call 2's
        # reply (18 + 5 + 3 + 3)
        ("summary", 49, 20, 29, 4),
        ("turn", 26, 8, 18, 6),
    ]


def _full_closed_form(t: Trajectory) -> list[tuple[int, int, int]]:
    """(prompt, prefilled, cached) per call: call k reads call k-1's prompt and its generated
    tokens but the last."""
    out, previous = [], None
    for a in t.calls:
        prompt = sum(s.tokens for s in t.specs[:a]) + t.generation_tokens
        cached = 0 if previous is None else \
            sum(s.tokens for s in t.specs[:previous]) + t.generation_tokens + t.specs[previous].generated - 1
        out.append((prompt, prompt - cached, cached))
        previous = a
    return out


def _standard_closed_form(t: Trajectory, threshold: int, summary: int, instruction: int, overhead: int):
    """Total (prefilled, cached, generated, summaries), summing by hand over the restarts."""
    g = t.generation_tokens
    head = sum(s.tokens for s in t.specs[:2])
    prefilled = cached = generated = summaries = 0
    base, since = head, 2  # tokens of the restart view; first message after it
    tree = 0  # tokens of the current view's prefix the cache holds
    for a in t.calls:
        body = sum(s.tokens for s in t.specs[since:a])
        if base + body + g > threshold and (base > head or since < a):
            prompt = base + body + instruction + g
            cached += tree
            prefilled += prompt - tree
            generated += summary
            base, since, summaries = head + summary + overhead, a, summaries + 1
            tree = head
            body = 0
        prompt = base + body + g
        cached += tree
        prefilled += prompt - tree
        generated += t.specs[a].generated
        tree = prompt + t.specs[a].generated - 1
    return prefilled, cached, generated, summaries


@pytest.mark.parametrize("seed", range(6))
def test_full_and_standard_equal_closed_forms_on_random_trajectories(seed):
    t = generate(SWE if seed % 2 else BROWSE, seed, turns=random.Random(seed).randint(3, 25))
    rows = simulate(t, FullContext())
    assert [(r.prompt, r.prefilled, r.cached) for r in rows] == _full_closed_form(t)
    threshold = t.total_tokens // 3
    total = totals(simulate(t, Summarize(threshold, 300, 20, 5)), PriceTable())
    p, c, gen, s = _standard_closed_form(t, threshold, 300, 20, 5)
    assert (total["prefilled"], total["cached"], total["generated"], total["summary_calls"]) == (p, c, gen, s)
    assert s >= 1


def test_counts_add_up_to_the_prompt_for_every_method():
    t = generate(BROWSE, 9, turns=30)
    policies = [reference_policy(4), lambda c: CachePolicy(trigger=TokenTrigger(20_000, c),
                                                           selector=TokenSelection(12_000, c),
                                                           reposition=TokenReposition(15_000, c))]
    methods = [FullContext(), Summarize(30_000), Trim(5)] + [AKV(p) for p in policies]
    for method in methods:
        for r in simulate(t, method):
            unread = r.prompt - (r.prefilled + r.cached + r.repos)
            assert 0 <= unread <= r.skipped, (method.name, r)
            assert r.live <= r.prompt


def test_trimming_reprefills_from_the_first_edit():
    t = generate(SWE, 2, turns=8)
    keep = 2
    rows = simulate(t, Trim(keep, placeholder_tokens=4))
    tools = [i for i, s in enumerate(t.specs) if s.role == "tool"]
    previous = None
    for row, a in zip(rows, t.calls):
        before = [i for i in tools if i < a]
        trimmed = before[:-keep] if len(before) > keep else []
        prompt = sum(4 if i in trimmed else t.specs[i].tokens for i in range(a)) + G
        assert row.prompt == prompt
        if previous is not None:
            prev_a, prev_trimmed = previous
            newly = sorted(set(trimmed) - set(prev_trimmed))
            # the cache holds the previous prompt up to its first difference with this one
            first_edit = newly[0] if newly else prev_a
            same = sum(4 if i in prev_trimmed else t.specs[i].tokens for i in range(first_edit))
            if not newly:
                same += G + t.specs[prev_a].generated - 1
            assert row.cached == same
        previous = (a, trimmed)


def test_akv_reads_instead_of_reprefilling():
    t = generate(SWE, 3, turns=40)
    full = totals(simulate(t, FullContext()), PriceTable())
    akv = totals(simulate(t, AKV(reference_policy(12))), PriceTable())
    # the same text arrives; AKV never re-prefills it, it only reads less of it
    assert akv["prefilled"] == full["prefilled"]
    assert akv["skipped"] > 0 and akv["repos"] > 0
    # what full context reads from the cache, AKV reads too or skips (skipped also counts dropped
    # tokens a call computed itself before its drop, which full context computes too)
    assert akv["cached"] + akv["repos"] <= full["cached"] <= akv["cached"] + akv["repos"] + akv["skipped"]
    assert akv["max_live"] < full["max_live"]


def _pool_after(run_pool):
    """Slots still referenced once the tree is flushed (every in-flight request is finished by then)."""
    run_pool.core.flush()
    return run_pool.core.pool.size - run_pool.core.pool.n_free


def test_shared_run_with_room_counts_what_each_conversation_counts_alone():
    trajectories = [generate(SWE, seed, f"swe-{seed}", turns=6) for seed in range(3)]
    method = AKV(reference_policy(2))
    shared = simulate_shared(trajectories, method, concurrency=3, pool_slots=1 << 20, start_turn=2)
    assert shared.waits == 0 and shared.refused == []
    alone = []
    for t in trajectories:  # each alone from the same turn; its first request is the primed one
        sim = Simulator(in_place=True)
        requests = [r for r in method.requests(t) if r.turn >= 2]
        alone.append([sim.run(r, t.generation_tokens, f"{t.name}#x", method.name) for r in requests][1:])
    rounds = zip(*alone)  # round robin: one request of each conversation per round
    expected = [_counts([row]) + [row.repos, row.live] for rnd in rounds for row in rnd]
    assert [_counts([row]) + [row.repos, row.live] for row in shared.rows] == expected
    assert len(shared.rows) == 3 * min(len(a) for a in alone)


def test_shared_run_on_a_small_pool_waits_refuses_and_leaks_nothing(monkeypatch):
    trajectories = [generate(BROWSE, seed, f"browse-{seed}", turns=8) for seed in range(4)]
    method = FullContext()
    made = []
    monkeypatch.setattr(simulator_module, "Simulator", lambda *a, **k: made.append(Simulator(*a, **k)) or made[-1])
    largest = max(sum(s.tokens for s in t.specs) for t in trajectories)
    shared = simulate_shared(trajectories, method, concurrency=4, pool_slots=largest + 64)
    assert shared.waits > 0 and shared.refused == [] and shared.peak_pool_used <= largest + 64
    assert _pool_after(made[-1]) == 0
    tiny = simulate_shared(trajectories, method, concurrency=2, pool_slots=1000)  # a system prompt alone is bigger
    assert sorted(tiny.refused) == ["browse-0#0", "browse-1#1"] and tiny.rows == []
    assert _pool_after(made[-1]) == 0


def test_protect_live_evicts_no_read_kv_while_others_are_in_flight(monkeypatch):
    trajectories = [generate(BROWSE, seed, f"browse-{seed}", turns=10) for seed in range(3)]
    method = AKV(reference_policy(2))
    pool = max(sum(s.tokens for s in t.specs) for t in trajectories)  # one whole text: pressure from turn ~6
    evictions = []  # (requests in flight, KV a path reads that the eviction released)
    original = RadixTree.evict

    def watched(tree, n_slots):
        read = tree.ranks()[2]
        held_before = set(tree.resident_slots().tolist())
        freed = original(tree, n_slots)
        gone = held_before - set(tree.resident_slots().tolist())
        evictions.append((made[-1].core.active, len(gone & set(read.tolist()))))
        return freed

    made = []
    monkeypatch.setattr(RadixTree, "evict", watched)
    monkeypatch.setattr(simulator_module, "Simulator", lambda *a, **k: made.append(Simulator(*a, **k)) or made[-1])
    plain = simulate_shared(trajectories, method, concurrency=3, pool_slots=pool)
    assert any(active and lost for active, lost in evictions)  # the default policy does evict read KV
    evictions.clear()
    guarded = simulate_shared(trajectories, method, concurrency=3, pool_slots=pool, protect_live=True)
    assert evictions and not any(active and lost for active, lost in evictions)
    # here waiting instead of evicting also saves a conversation the default refuses, and prefill
    assert guarded.waits > plain.waits and guarded.refused == [] and plain.refused
    assert sum(r.prefilled for r in guarded.rows) < sum(r.prefilled for r in plain.rows)
    assert _pool_after(made[-1]) == 0
