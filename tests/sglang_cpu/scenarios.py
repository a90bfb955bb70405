"""The scenario matrix served through SGLang's real scheduler: conversations as token-id messages
with the drops and repositions an agent would send, turned into driver jobs (waves of requests)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from akv.system.context.compiler import compile_program
from akv.system.context.program import ContextProgram
from akv.system.context.rules import parse_rules
from akv.system.context.wire import encode_program

VOCAB = 500
GEN_PROMPT = 3


@dataclass(frozen=True)
class Request:
    """One request: ``program`` for a context request, None for a plain one (``ids`` only)."""

    rid: str
    ids: tuple[int, ...]
    program: ContextProgram | None
    max_new: int = 4
    abort_after: int | None = None
    abort_after_forwards: int | None = None

    def job(self) -> dict:
        encoded = None if self.program is None else base64.b64encode(encode_program(self.program)).decode()
        return {"rid": self.rid, "ids": list(self.ids), "program": encoded, "max_new": self.max_new}


@dataclass
class Conversation:
    """Messages (token lists) and the cumulative operations sent with every later request."""

    seed: int
    messages: list[list[int]] = field(default_factory=list)
    drops: dict[int, list[int]] = field(default_factory=dict)
    repositions: list[int] = field(default_factory=list)

    def add(self, *lengths: int) -> Conversation:
        rng = np.random.default_rng(self.seed * 1000 + len(self.messages))
        self.messages.extend(rng.integers(0, VOCAB, n).tolist() for n in lengths)
        return self

    def drop(self, *message_ids: int) -> Conversation:
        self.drops.setdefault(len(self.messages) - 1, []).extend(message_ids)
        return self

    def reposition(self) -> Conversation:
        self.repositions.append(len(self.messages) - 1)
        return self

    def request(self, rid: str, *, plain: bool = False, **kwargs: object) -> Request:
        n = len(self.messages)
        gen = np.random.default_rng(self.seed).integers(0, VOCAB, GEN_PROMPT).tolist()
        ids = [t for m in self.messages for t in m] + gen
        if plain:
            return Request(rid, tuple(ids), None, **kwargs)
        owners = [i for i, m in enumerate(self.messages) for _ in m] + [n] * GEN_PROMPT
        drop_message = {str(a): list(ms) for a, ms in self.drops.items()} or None
        rules = parse_rules(drop_message, list(self.repositions) or None, n)
        program = compile_program(np.array(ids, dtype=np.int64), np.array(owners, dtype=np.int64), rules, n)
        return Request(rid, tuple(ids), program, **kwargs)

    def copy(self, seed: int | None = None) -> Conversation:
        return Conversation(self.seed if seed is None else seed, [list(m) for m in self.messages],
                            {a: list(m) for a, m in self.drops.items()}, list(self.repositions))


def tool_conversation(seed: int, turns: int, prefix: str) -> list[Request]:
    """An agent loop: a user task, then per turn an assistant call and a tool result; from the
    second turn on the oldest kept tool result is dropped every turn, repositioned every 3."""
    conv = Conversation(seed).add(7, 5)
    requests = [conv.request(f"{prefix}-0")]
    for turn in range(1, turns):
        conv.add(4, 9)
        kept = [m for m in range(2, len(conv.messages) - 2, 2) if not any(m in v for v in conv.drops.values())]
        if kept:
            conv.drop(kept[0])
        if turn % 3 == 0:
            conv.reposition()
        requests.append(conv.request(f"{prefix}-{turn}"))
    return requests


def matrix() -> list[list[Request]]:
    """Waves of the full matrix, in order; requests in one wave run concurrently."""
    waves: list[list[Request]] = []
    base = Conversation(1).add(6, 9, 7, 8)
    waves.append([base.copy().drop(1).request("drop-only")])
    waves.append([Conversation(2).add(6, 9, 7, 8).reposition().request("repos-only")])
    waves.append([base.copy().drop(1, 2).reposition().request("drop-and-repos")])
    # Figure 5: compute C then drop A / drop A then compute C / never had A (A = message 1, C = message 3)
    fig = Conversation(3).add(5, 6, 6, 6)
    waves.append([fig.copy().drop(1).request("fig5-drop-after-c")])
    early = Conversation(3).add(5, 6, 6)
    early.drop(1)
    early.messages.append(list(fig.messages[3]))
    waves.append([early.request("fig5-drop-before-c")])
    never = Conversation(3)
    never.messages = [list(fig.messages[i]) for i in (0, 2, 3)]
    waves.append([never.request("fig5-never-a")])
    # a plain first turn, then context turns over the same history, then plain again
    agent = Conversation(4).add(8, 6, 9)
    waves.append([agent.request("agent-plain-1", plain=True)])
    agent.add(5, 7).drop(2).reposition()
    waves.append([agent.request("agent-context-2")])
    agent.add(4, 6).drop(4)
    waves.append([agent.request("agent-context-3")])
    waves.append([Conversation(4).add(8, 6, 9).request("agent-plain-again", plain=True)])
    # two branches of one conversation, one after the other
    trunk = Conversation(5).add(6, 6, 6, 6)
    waves.append([trunk.copy().drop(1).add(5).request("branch-a")])
    waves.append([trunk.copy().drop(2).reposition().add(5).request("branch-b")])
    # a 10-turn tool conversation, one request per turn
    waves.extend([r] for r in tool_conversation(6, 10, "tool"))
    waves.extend(in_place_waves())
    # concurrent context and plain requests (distinct conversations: no reuse between them)
    waves.append([Conversation(7).add(9, 8, 7).drop(1).reposition().request("mixed-ctx-a", max_new=6),
                  Conversation(8).add(7, 7, 7, 7).request("mixed-plain", plain=True, max_new=6),
                  Conversation(9).add(8, 5, 9, 4).drop(2).request("mixed-ctx-b", max_new=6)])
    return waves


def in_place_turns(seed: int, prefix: str) -> tuple[Conversation, list[Request]]:
    """A first turn (6, 9, 7, 8 tokens and the generation prompt; one new token, so nothing generated
    is cached), the next turn over exactly that text (its generation prompt now a message) with message
    1 dropped and the rest repositioned (18 resident tokens move from 15..32 to 6..23) and 5 + 3 new
    tokens, and the turn after it, 4 + 3 new tokens and no new operation. The conversation holds
    the first turn's text."""
    conv = Conversation(seed).add(6, 9, 7, 8)
    first = conv.request(f"{prefix}-1", max_new=1)
    gen = list(first.ids[-GEN_PROMPT:])
    second = conv.copy()
    second.messages.append(gen)
    second.drop(1).reposition().add(5)
    third = second.copy()
    third.messages.append(gen)
    third.add(4)
    return conv, [first, second.request(f"{prefix}-2", max_new=1), third.request(f"{prefix}-3", max_new=4)]


def in_place_waves() -> list[list[Request]]:
    """One request per wave: a conversation whose second turn rotates its resident KV in place (nothing
    else reads the old positions) and whose third reads it as cached; another whose first turn has a
    sibling branch, published before and sent again after the repositioning turn, still reading the
    old positions (that turn must copy); a third whose repositioning turn and such a sibling arrive
    in one wave (the sibling first)."""
    _, inplace = in_place_turns(100, "inplace")
    sib, sibling = in_place_turns(101, "sibling")
    reader = sib.copy()
    reader.messages.append(list(sibling[0].ids[-GEN_PROMPT:]))
    reader.add(4)
    read = reader.request("sibling-reader", max_new=1)
    again = Request("sibling-reader-again", read.ids, read.program, max_new=4)
    race_conv, race = in_place_turns(102, "race")
    racer = race_conv.copy()
    racer.messages.append(list(race[0].ids[-GEN_PROMPT:]))
    racer.add(4)
    return ([[r] for r in inplace] + [[sibling[0]], [read], [sibling[1]], [again]]
            + [[race[0]], [racer.request("race-reader", max_new=4), race[1]]])


def in_place_abort_waves() -> list[list[Request]]:
    """One request per wave: a first turn (6, 9, 7, 8 tokens and the generation prompt), the next turn
    over exactly its text that drops message 1 and repositions the 18 tokens after it (resident KV no
    one else reads: rotated in place in its first round) and adds 40 new tokens, aborted after its
    first forward (mid-prefill: its rotation ran, its later rounds did not); the same turn sent
    again; the turn after it; and a plain request of the first turn's text."""
    conv = Conversation(105).add(6, 9, 7, 8)
    first = conv.request("iabort-1", max_new=1)
    turn = conv.copy()
    turn.messages.append(list(first.ids[-GEN_PROMPT:]))
    turn.drop(1).reposition().add(40)
    aborted = turn.request("iabort-2", max_new=4, abort_after_forwards=1)
    after = turn.copy()
    after.messages.append(list(aborted.ids[-GEN_PROMPT:]))
    after.add(4)
    return [[first], [aborted], [Request("iabort-2-again", aborted.ids, aborted.program, max_new=1)],
            [after.request("iabort-3", max_new=4)], [Request("iabort-plain", first.ids, None, max_new=4)]]


def plain_reader_race_waves() -> list[list[Request]]:
    """Two conversations' first turns (33 tokens), each followed by a wave of its repositioning turn
    (18 resident tokens rotated in place, 8 new) and a plain request of the first turn's text, which
    reads those 18 tokens at their old positions: the turn first in one wave, the plain request
    first in the other. Both fit one batch (chunk budget 64)."""
    waves = []
    for seed, order in ((106, "turn-first"), (107, "plain-first")):
        _, (first, turn, _) = in_place_turns(seed, order)
        reader = Request(f"{order}-plain", first.ids, None, max_new=4)
        waves += [[first], [turn, reader] if order == "turn-first" else [reader, turn]]
    return waves


def retraction_waves() -> list[list[Request]]:
    """Concurrent context requests long enough in decode for forced retractions to hit them, one of
    them a turn that rotates 18 resident tokens in place (its first turn is sent in a wave before)."""
    _, (first, turn, _) = in_place_turns(108, "retract-in-place")
    return [[first],
            [Conversation(10).add(9, 8, 7).drop(1).reposition().request("retract-a", max_new=12),
             Conversation(11).add(8, 9, 6, 5).drop(2).request("retract-b", max_new=12),
             Conversation(12).add(7, 7, 7).request("retract-plain", plain=True, max_new=12),
             Request(turn.rid, turn.ids, turn.program, max_new=12)]]


def pressure_waves() -> list[list[Request]]:
    """Three requests of which any two overflow a 140-slot pool (one re-rotates 40 tokens): all
    three are sent at once, so admission must make the others wait and evict what finished."""
    return [[Conversation(20).add(20, 20, 20).drop(1).reposition().request("press-a", max_new=10),
             Conversation(21).add(20, 20, 20).drop(0).reposition().request("press-b", max_new=10),
             Conversation(22).add(20, 20, 20).request("press-plain", plain=True, max_new=10)]]


def copy_budget_waves() -> list[list[Request]]:
    """Two warm conversations, then in one wave a turn of each that drops message 1 and
    repositions: 13 births and 40 re-rotation copies each. A 216-slot pool holds either turn but not
    both at once: the second must wait because of its copies (its births alone would fit).
    Then two more conversations of 100 tokens each, and in one wave a turn of each over exactly that
    text that drops message 1 (20 tokens) and repositions the 70 after it, which nothing else reads:
    rotated in place, each turn holds 80 resident and 8 new slots, and both fit at once (with 70
    copies each they would not)."""
    warm = [Conversation(seed).add(20, 20, 20, 20) for seed in (30, 31)]
    fresh = [Conversation(seed).add(10, 20, 20, 47) for seed in (35, 36)]
    firsts = [c.request(f"budget-first-{i}", max_new=1) for i, c in enumerate(fresh)]
    turns = []
    for i, (c, first) in enumerate(zip(fresh, firsts)):
        turn = c.copy()
        turn.messages.append(list(first.ids[-GEN_PROMPT:]))
        turns.append(turn.drop(1).reposition().add(5).request(f"budget-in-place-{i}", max_new=1))
    return [[c.request(f"budget-warm-{i}", plain=True) for i, c in enumerate(warm)],
            [c.copy().drop(1).reposition().add(10).request(f"budget-turn-{i}") for i, c in enumerate(warm)],
            firsts, turns]


def segment_join_waves() -> list[list[Request]]:
    """A warm conversation's turn with two segments (its drop anchored at its last message) sent
    together with two short plain requests: they fit the chunk budget its rounds leave."""
    conv = Conversation(32).add(7, 5, 4, 9)
    return [[conv.request("join-warm", plain=True)],
            [conv.copy().add(4, 9).drop(2).request("join-turn"),
             Conversation(33).add(6, 5).request("join-plain-0", plain=True),
             Conversation(34).add(5, 6).request("join-plain-1", plain=True)]]


def parallel_rounds_waves() -> list[list[Request]]:
    """Three warm conversations' two-segment turns (drop anchored at the last message) and two cold
    five-segment requests, sent together: SGLang's prefill budget for all of them fits one chunk of
    128, so all run their rounds side by side; one cold request is aborted after its first round."""
    convs = [Conversation(41 + i).add(7, 5, 4, 9) for i in range(3)]
    cold = [Conversation(45 + i).add(6, 6).drop(0).add(6, 6).drop(2).add(6, 6).drop(4).add(6, 6).drop(6).add(6, 6)
            for i in range(2)]
    return [[c.request(f"rounds-warm-{i}", plain=True) for i, c in enumerate(convs)],
            [*(c.copy().add(4, 9).drop(2).request(f"rounds-turn-{i}") for i, c in enumerate(convs)),
             cold[0].request("rounds-cold"),
             cold[1].request("rounds-cold-aborted", abort_after_forwards=1)]]


def rounds_pressure_waves(mix: str) -> list[list[Request]]:
    """Requests of five segments (123 columns each) sent at once on a pool that holds one of them
    but not two: ``"copies"``, one request three times (the same tokens and drops); ``"two-and-one"``,
    one twice and another conversation's. Each round ends at a segment's end, so a second request's
    first round fits the chunk budget the first one's rounds leave."""
    def five_segments(seed: int) -> Conversation:
        conv = Conversation(seed).add(12, 12)
        for anchor in (0, 2, 4, 6):
            conv.drop(anchor).add(12, 12)
        return conv
    same = five_segments(60).request("same")
    copies = [Request(f"copy-{i}", same.ids, same.program) for i in range(3 if mix == "copies" else 2)]
    others = [five_segments(61).request("other")] if mix == "two-and-one" else []
    return [copies + others]


def copies_near_the_pool_waves(n_copies: int) -> list[list[Request]]:
    """A context turn, plain requests that evict its KV, then at once ``n_copies`` copies of the next
    turn (three earlier messages dropped, one more dropped and repositioned now: four segments and 72
    copy slots cold, 195 slots in all), another conversation's turn like it and a plain request. Each
    copy's births and copies fit a 200-slot pool, but not with its 6 new tokens: SGLang's admission
    never fits it, so its new tokens must be cut to what the pool leaves (as SGLang does for a plain
    prompt); otherwise it waits forever and the whole queue with it."""
    def turns(seed: int, n: int) -> Conversation:
        conv = Conversation(seed).add(12, 12)
        for t in range(n):
            conv.add(12, 12).drop(2 * t)
            if t % 2 == 1:
                conv.reposition()
        return conv
    main = turns(70, 3)
    fillers = [Conversation(80 + i).add(20, 20).request(f"near-fill-{i}", plain=True) for i in range(4)]
    same = main.copy().add(12, 12).drop(6).reposition().request("near-same", max_new=6)
    copies = [Request(f"near-copy-{i}", same.ids, same.program, max_new=6) for i in range(n_copies)]
    return [[main.request("near-warm")], fillers,
            copies + [turns(71, 4).request("near-other", max_new=6),
                      Conversation(90).add(15, 15).request("near-plain", plain=True, max_new=6)]]


def copies_beyond_the_pool_waves() -> list[list[Request]]:
    """A conversation's turn that drops its second message and repositions the three after it, sent
    cold (163 births; re-rotating them into copies would take 253 slots, more than a 200-slot pool),
    then its next turn, which drops another message and repositions again, over the first turn's
    published KV: each fits the pool only with what it repositions re-rotated in place."""
    conv = Conversation(95).add(30, 30, 30, 30, 30).drop(1).reposition().add(10)
    first = conv.request("beyond-cold", max_new=6)
    conv.add(8).drop(3).reposition()
    return [[first], [conv.request("beyond-next", max_new=6)]]



def longer_than_the_pool_waves() -> list[list[Request]]:
    """For a 200-slot pool: a conversation of two 10-token messages, then 15 turns of 40 tokens,
    each dropping the turn two before it and repositioning, sent cold as one request (its text is
    over 600 tokens, its live part about 100: each round holds the kept messages, the turn before
    and its own). Then another such conversation, aborted after two forwards (mid-prefill, some
    births already given back), then sent again (cold: the abort published nothing)."""
    def long(seed: int) -> Conversation:
        conv = Conversation(seed).add(10, 10)
        for _ in range(15):
            conv.add(40)
            if len(conv.messages) > 4:
                conv.drop(len(conv.messages) - 3)
            conv.reposition()
        return conv

    other = long(121).request("longer-than-pool-aborted", max_new=4, abort_after_forwards=2)
    return [[long(120).request("longer-than-pool", max_new=4)], [other],
            [Request("longer-than-pool-again", other.ids, other.program, max_new=4)]]


def next_turn(conv: Conversation, first: Request, *lengths: int) -> Conversation:
    """``conv`` after ``first`` (one generated token, so nothing generated is cached): its generation
    prompt kept as a message, then new messages of ``lengths`` tokens."""
    after = conv.copy()
    after.messages.append(list(first.ids[-GEN_PROMPT:]))
    return after.add(*lengths)


def protect_live_waves() -> list[list[Request]]:
    """For ``--akv-protect-live`` on a 200-slot pool (chunk budget 128). A context conversation B (24
    tokens) and a plain one P (16) leave their live KV in the tree. Then together: A, a context
    request of 83 tokens whose drop at its last message hides message 1 (60 tokens, computed: message
    2 reads it) from its generation prompt on, 8 new tokens; and C, a context request of 90 tokens.
    A and C need 173 slots at once, 13 more than are free: without the flag C is admitted beside A
    and evicts B's and P's live KV; with it C waits until A finishes, and then A's 60 dropped
    slots (freed first) make its room. Then B's and P's next turns, then a queue whose head D (120
    tokens) fits only by evicting live KV (every conversation's KV is live by then), followed by E."""
    b = Conversation(110).add(13, 8)
    b1 = b.request("live-b-1", max_new=1)
    p = Conversation(111).add(13)
    p1 = p.request("live-p-1", plain=True, max_new=1)
    dropping = Conversation(112).add(10, 60, 10).drop(1).request("live-a", max_new=8)
    cold = Conversation(113).add(87).request("live-c", max_new=4)
    turns = [next_turn(b, b1, 7).request("live-b-2"), next_turn(p, p1, 5).request("live-p-2", plain=True)]
    queue = [Conversation(114).add(117).request("live-d", plain=True),
             Conversation(115).add(7).request("live-e", plain=True)]
    return [[b1], [p1], [dropping, cold], turns, queue]


def abort_waves() -> list[list[Request]]:
    """Abort mid-segment and mid-decode; the next requests must be served exactly."""
    long = Conversation(13).add(9, 9, 9, 9, 9).drop(1).reposition().add(9, 9).drop(3)
    decode = Conversation(14).add(8, 8, 8).drop(1)
    return [
        [long.request("abort-mid-segment", abort_after=0)],
        [decode.request("abort-mid-decode", max_new=60, abort_after=2)],
        [long.request("after-abort"), decode.request("after-abort-2")],
    ]


def plain_waves() -> list[list[Request]]:
    """Plain traffic with shared prefixes and chunked prompts, for the stock differential."""
    conv = Conversation(15).add(9, 12, 10)
    return [
        [conv.request("plain-1", plain=True)],
        [conv.copy().add(11).request("plain-2", plain=True)],
        [conv.copy().add(11, 6).request("plain-3", plain=True), Conversation(16).add(14, 9).request("plain-4", plain=True)],
        [conv.request("plain-1-again", plain=True)],
    ]


def job(waves: list[list[Request]]) -> list[dict]:
    return [{"requests": [r.job() for r in wave],
             "aborts": {r.rid: r.abort_after for r in wave if r.abort_after is not None},
             "aborts_after_forwards": {r.rid: r.abort_after_forwards for r in wave
                                       if r.abort_after_forwards is not None}} for wave in waves]
