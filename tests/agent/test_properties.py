"""Property tests over generated tool-using conversations, against a brute-force reference."""

from __future__ import annotations

import copy
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from akv.agent import (
    ApproximateTokenCounter,
    CachePolicy,
    TokenSelection,
    TokenTrigger,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)

from .conversations import payload, random_conversation

ROLES = {"tool": {"tool"}, "assistant": {"assistant"}, "both": {"tool", "assistant"}}


def scheduled(turn: int, after: int, every: int | None) -> bool:
    return turn == after or (every is not None and turn > after and (turn - after) % every == 0)


def batch_ends(messages):
    """Indices of tool messages that are not followed by another tool message."""
    return [i for i, m in enumerate(messages)
            if m["role"] == "tool" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool")]


def protected_ids(messages, exclude):
    names = {}
    for m in messages:
        for c in m.get("tool_calls") or ():
            names[c["id"]] = c["function"]["name"]
    out = {i for i, m in enumerate(messages) if m["role"] in ("system", "developer")}
    out.add(next(i for i, m in enumerate(messages) if m["role"] == "user"))
    for i, m in enumerate(messages):
        if m["role"] == "tool" and names[m["tool_call_id"]] in exclude:
            out.add(i)
        if any(names[c["id"]] in exclude for c in m.get("tool_calls") or ()):
            out.add(i)
    return out


def reference_turn_policy(messages, *, after, every, count, target, r_after, r_every, exclude, min_clear):
    ends = batch_ends(messages)
    turn_of = [1 + sum(1 for b in ends if b < i) for i in range(len(messages))]
    protected = protected_ids(messages, exclude)
    hidden, compacted = set(), set()
    drop, reposition = {}, []
    for k, b in enumerate(ends, 1):
        if scheduled(k, after, every):
            chosen = [i for i in range(b + 1) if turn_of[i] <= k - count and messages[i]["role"] in ROLES[target]
                      and i not in protected and i not in hidden]
            if chosen and len(chosen) >= min_clear:
                drop[str(b)] = chosen
                hidden.update(chosen)
        if r_after is not None and scheduled(k, r_after, r_every) and hidden - compacted:
            reposition.append(b)
            compacted = set(hidden)
    return drop, reposition


def reference_token_policy(messages, counter, threshold, target_tokens):
    layout = counter.layout(messages, tools=payload(messages)["tools"])
    size = [e - s for s, e in layout.spans]
    ends = batch_ends(messages)
    protected = protected_ids(messages, ())
    hidden, drop = set(), {}
    for k, b in enumerate(ends):
        previous = ends[k - 1] if k else -1
        visible = sum(size[i] for i in range(b + 1) if i not in hidden) + layout.generation_tokens
        if visible <= threshold:
            continue
        chosen = []
        for i in range(previous + 1):
            if visible <= target_tokens:
                break
            if messages[i]["role"] == "tool" and i not in protected and i not in hidden:
                chosen.append(i)
                visible -= size[i]
        if chosen:
            drop[str(b)] = chosen
            hidden.update(chosen)
    return drop


conversations = st.builds(lambda seed, turns, system: random_conversation(random.Random(seed), turns, system=system),
                          st.integers(0, 2**32), st.integers(1, 14), st.booleans())
schedules = st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 3)))


@settings(max_examples=120, deadline=None)
@given(conversations, schedules, st.integers(1, 3), st.sampled_from(sorted(ROLES)),
       st.one_of(st.none(), schedules), st.sampled_from([(), ("memory",), ("search", "memory")]), st.integers(1, 3))
def test_turn_rules_match_the_brute_force_reference(messages, schedule, count, target, r_schedule, exclude,
                                                    min_clear):
    policy = CachePolicy(trigger=TurnTrigger(*schedule), selector=TurnSelection(count, target),
                         reposition=TurnReposition(*r_schedule) if r_schedule else None,
                         exclude_tools=exclude, min_clear_messages=min_clear)
    original = payload(messages)
    snapshot = copy.deepcopy(original)
    new, history = policy.process(original)
    drop, reposition = reference_turn_policy(
        messages, after=schedule[0], every=schedule[1], count=count, target=target,
        r_after=r_schedule[0] if r_schedule else None, r_every=r_schedule[1] if r_schedule else None,
        exclude=exclude, min_clear=min_clear)
    assert new.get("drop_message", {}) == drop
    assert new.get("reposition", []) == reposition
    assert original == snapshot and new["messages"] == snapshot["messages"]
    assert policy.process(copy.deepcopy(original)) == (new, history)


@settings(max_examples=60, deadline=None)
@given(conversations, st.integers(50, 400), st.integers(10, 300))
def test_token_rules_match_the_brute_force_reference(messages, threshold, target_tokens):
    counter = ApproximateTokenCounter(chars_per_token=3.0)
    policy = CachePolicy(trigger=TokenTrigger(threshold, counter), selector=TokenSelection(target_tokens, counter))
    new, _ = policy.process(payload(messages))
    assert new.get("drop_message", {}) == reference_token_policy(messages, counter, threshold, target_tokens)


@settings(max_examples=60, deadline=None)
@given(conversations, schedules, st.integers(1, 3), st.sampled_from(sorted(ROLES)), schedules)
def test_incremental_calls_agree_with_one_cold_call_and_fields_only_grow(messages, schedule, count, target,
                                                                         r_schedule):
    counter = ApproximateTokenCounter()
    policy = CachePolicy(trigger=TurnTrigger(*schedule), selector=TurnSelection(count, target),
                         reposition=TurnReposition(*r_schedule), min_clear_tokens=5, counter=counter)
    ends = batch_ends(messages)
    cuts = sorted({e + 1 for e in ends} | {len(messages)})
    history = None
    previous = {}
    for cut in cuts:
        new, history = policy.process(payload(messages[:cut]), history)
        fields = {k: new[k] for k in ("drop_message", "reposition") if k in new}
        for key, value in previous.get("drop_message", {}).items():
            assert fields["drop_message"][key] == value
        assert fields.get("reposition", [])[:len(previous.get("reposition", []))] == previous.get("reposition", [])
        previous = fields
    cold, cold_history = policy.process(payload(messages))
    assert {k: cold[k] for k in previous} == previous and set(previous) == set(cold) - set(payload(messages))
    assert cold_history == history


@settings(max_examples=80, deadline=None)
@given(conversations, st.randoms(use_true_random=False), st.sampled_from([(), ("read_record",)]))
def test_any_selector_output_is_filtered_to_earlier_unprotected_unhidden_messages(messages, rng, exclude):
    def chaotic(ctx):
        return rng.sample(range(ctx.boundary + 1), k=rng.randint(0, ctx.boundary + 1))

    new, history = CachePolicy(selector=chaotic, exclude_tools=exclude).process(payload(messages))
    protected = protected_ids(messages, exclude)
    ends = batch_ends(messages)
    seen = set()
    for key, ids in new.get("drop_message", {}).items():
        b = int(key)
        assert b in ends
        previous = max((e for e in ends if e < b), default=-1)
        assert ids == sorted(ids) and all(0 <= i <= previous for i in ids)
        assert not (set(ids) & protected) and not (set(ids) & seen)
        seen.update(ids)
    assert history.hidden == frozenset(seen)
