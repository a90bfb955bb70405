"""Prefill–decode disaggregation of context requests (akv.system.adapter.disaggregation), on the CPU:
the prefill server's send list and the decode server's layout against the brute-force KV model.

Each turn is planned and run on a simulated prefill server (the adapter's own AkvRequest over a cache
core, births bound as SGLang binds them, every read checked by tests/cache/brute.py); its send list
moves the labels of those slots into a simulated decode server, which generates the reply there. Every
decode query must read exactly the keys the definitional model says, in the single server's column
order, each at its position; the usage the decode server reports is the prefill plan's. The prefill
server publishes only the prompt (the reply's KV stays on the decode server), and leaks nothing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.disaggregation import (
    CONTEXT_MARKER,
    METADATA_COLUMNS,
    DecodeLayout,
    PdMetadata,
    PrefillSend,
    check_received,
    prefill_send,
)
from akv.system.cache.core import CacheCore
from akv.system.cache.plan import Usage
from akv.system.cache.pool import ArrayFreeList, SlotPool
from akv.system.context.compiler import append_generated
from tests.cache.brute import Interner, SimulatedKV, brute_layout
from tests.cache.conversations import Conversation, conversations

MESSAGES = ((1, 2), (3, 4), (5, 6), (7, 8), (9,))
POOL = 400


def _in_place(plan) -> set[int]:
    return {int(d) for job in plan.copies for s, d in zip(job.src, job.dst) if s == d}


def _core(size: int, kv: SimulatedKV) -> tuple[CacheCore, ArrayFreeList]:
    """A cache core whose free list the test draws births from, as SGLang's allocator does."""
    free = ArrayFreeList(size)
    return CacheCore(SlotPool(size, on_free=kv.forget, free_list=free)), free


def _births(core: CacheCore, free: ArrayFreeList, n: int) -> np.ndarray:
    if free.n_free < n:
        core.tree.evict(n - free.n_free)
    slots = free.take(n)
    assert slots is not None, f"pool of {core.pool.size} short of {n} slots"
    return slots


def _prefill(core: CacheCore, free: ArrayFreeList, kv: SimulatedKV, conv: Conversation, turn: int,
             intern: Interner) -> tuple[AkvRequest, PrefillSend]:
    """One turn on the prefill server: plan, lock, commit, bind each segment's births, run it on the
    brute-force KV (segments, then the terminal copies), and take its send list."""
    program = conv.program(turn)
    state = AkvRequest(program)
    state.plan_draft(core)
    state.lock(core)
    state.commit(core)
    for segment in state.plan_segments:
        state.bind(core, segment.start, _births(core, free, segment.n_queries))
    plan = state.active.resolved_plan()
    kv.execute(plan, brute_layout(program, intern), core.pool, rewritable=_in_place(plan))
    return state, prefill_send(state)


def _check_decode(send: PrefillSend, kv: SimulatedKV, state: AkvRequest, conv: Conversation, turn: int,
                  intern: Interner) -> None:
    """The decode server's side of one turn: what arrives is what generation reads, in order; its
    own program gives the same layout as the metadata; every generated query reads exactly what the
    definitional model's query reads, in the single server's column order, at the same position."""
    program = conv.program(turn)  # compiled again from the same body, as the decode server does
    layout = DecodeLayout.of(program)
    row = np.zeros(16, dtype=np.int32)
    send.metadata.write(row)
    received = PdMetadata.read(row)
    assert check_received(layout, received) is None
    assert received.usage == state.first_usage, "the decode server reports the prefill plan's usage"

    reply = conv.reply(turn)
    n = program.n_tokens
    full = brute_layout(append_generated(program, reply), intern)
    terminal = brute_layout(program, intern).terminal  # what the single server's generation reads
    kept = sorted(terminal)
    assert layout.visible == len(kept), "V is the visible count"
    assert send.slots.size == layout.visible
    columns = [kv.content[int(s)] for s in send.slots]  # the transfer: column i <- send.slots[i]
    assert columns == [terminal[t] for t in kept], "received columns are the kept keys in column order at their final positions"

    for j in range(reply.size):
        column = layout.visible + j
        position = column + layout.offset
        assert position == full.birth[n + j], f"generated token {j}: position {position}"
        assert position == n + j + state.decode_offset(), "the single server's position"
        columns.append((full.names[n + j], position))
        reads = columns[: column + 1]  # every received and generated column is visible
        assert len(reads) == len(set(reads)) and set(reads) == full.reads[n + j], f"generated token {j}"


def _serve_pd(first: Conversation, second: Conversation) -> None:
    kv = SimulatedKV()
    core, free = _core(POOL, kv)
    pool = core.pool
    intern = Interner()
    order = [(c, t) for t in range(8) for c in (first, second) if t < c.n_turns for _ in range(2)]
    for conv, turn in order:
        state, send = _prefill(core, free, kv, conv, turn, intern)
        _check_decode(send, kv, state, conv, turn, intern)
        state.release(core, publish=True)  # the prefill server keeps the prompt's KV only
    core.flush()
    assert pool.n_free == pool.size and not kv.content


@settings(max_examples=100, deadline=None)
@given(conversations(max_messages=8).flatmap(lambda c: st.tuples(st.just(c), conversations(max_messages=8, prefix=c))))
def test_the_send_list_and_decode_layout_read_what_the_single_server_reads(pair) -> None:
    """Random conversations and a fork of each (random drops, repositions, shared prefixes with other
    histories), every turn twice, served alternately through PD (module docstring)."""
    _serve_pd(*pair)


def _hand_turn(drops: dict[int, tuple[int, ...]], repositions: tuple[int, ...]):
    kv = SimulatedKV()
    core, free = _core(64, kv)
    conv = Conversation(MESSAGES, drops, repositions)
    state, send = _prefill(core, free, kv, conv, 3, Interner())
    return core, kv, conv, state, send


def test_a_drop_without_reposition_sends_six_columns_and_generates_at_position_eight() -> None:
    """Messages 0..3 (8 tokens), message 1 dropped after message 2, no reposition: V = 6 (tokens
    0, 1, 4, 5, 6, 7), and the first generated token is at position 8, column 6."""
    core, kv, conv, state, send = _hand_turn({2: (1,)}, ())
    assert send.tokens.tolist() == [0, 1, 4, 5, 6, 7]
    assert send.layout == DecodeLayout(visible=6, next_position=8) and send.layout.offset == 2
    assert [kv.content[int(s)][1] for s in send.slots] == [0, 1, 4, 5, 6, 7], "gapped final positions"
    assert send.usage == Usage(cached_tokens=0, repos_tokens=0, drop_skipped_tokens=2, computed_tokens=8)
    _check_decode(send, kv, state, conv, 3, Interner())
    state.release(core, publish=False)
    assert core.pool.n_free == core.pool.size


def test_a_reposition_sends_keys_at_zero_to_five_and_generates_at_six() -> None:
    """The same drop with a reposition after message 2: tokens 4, 5 move to 2, 3; the terminal keys
    sit at 0..5 and the next position is V."""
    core, kv, conv, state, send = _hand_turn({2: (1,)}, (2,))
    assert send.tokens.tolist() == [0, 1, 4, 5, 6, 7]
    assert send.layout == DecodeLayout(visible=6, next_position=6)
    assert [kv.content[int(s)][1] for s in send.slots] == [0, 1, 2, 3, 4, 5]
    _check_decode(send, kv, state, conv, 3, Interner())
    state.release(core, publish=False)


def test_the_check_rejects_a_wrong_order_and_a_wrong_v() -> None:
    """The PD check fails for a send list in another order, for V taken as the prompt's length, and for
    the next position taken as V (what stock SGLang's decode would use)."""
    core, kv, conv, state, send = _hand_turn({2: (1,)}, ())
    reversed_order = replace(send, slots=send.slots[::-1].copy())
    with pytest.raises(AssertionError, match="column order"):
        _check_decode(reversed_order, kv, state, conv, 3, Interner())
    text_length = replace(send, layout=DecodeLayout(visible=8, next_position=8))
    assert check_received(DecodeLayout.of(conv.program(3)), text_length.metadata) is not None
    with pytest.raises(AssertionError):
        _check_decode(text_length, kv, state, conv, 3, Interner())
    assert "V=6, next_position=8" in check_received(send.layout, replace(send, layout=DecodeLayout(6, 6)).metadata)
    state.release(core, publish=False)


def test_metadata_rides_in_the_spare_columns_of_the_cached_tokens_row() -> None:
    """Columns 0–6 (SGLang's cached and multimodal counts) are left alone; a plain request's row reads
    as None, which the decode server refuses for a context request."""
    meta = PdMetadata(DecodeLayout(5, 9), Usage(3, 1, 4, 2))
    row = torch.full((16,), 77, dtype=torch.int32)  # one row of SGLang's MetadataBuffers.cached_tokens
    meta.write(row)
    assert row[:7].tolist() == [77] * 7 and row[14:].tolist() == [77, 77]
    assert row[list(METADATA_COLUMNS)].tolist() == [CONTEXT_MARKER, 5, 9, 3, 1, 4, 2]
    assert PdMetadata.read(row) == meta
    plain = np.zeros(16, dtype=np.int32)
    assert PdMetadata.read(plain) is None
    assert "did not send context-request metadata" in check_received(meta.layout, None)
    with pytest.raises(ValueError, match="int32"):
        PdMetadata(DecodeLayout(2**31, 2**31), Usage(0, 0, 0, 0)).columns()


def _computed_per_turn(conv: Conversation, *, pd: bool) -> list[int]:
    """``computed_tokens`` of each turn, served in order by one cache core: as one server (the reply's
    KV, all but its last token's, is published with the turn) or as a PD prefill server (the reply's KV
    stays on the decode server, so only the prompt is published)."""
    core = CacheCore(SlotPool(POOL))
    out = []
    for turn in range(conv.n_turns):
        request = core.admit(conv.program(turn), in_place=True)
        out.append(request.plan.usage.computed_tokens)
        reply = conv.reply(turn)[:-1]
        if pd:
            core.finish(request)
        else:
            core.finish(request, reply, core.allocate(reply.size))
    return out


@settings(max_examples=100, deadline=None)
@given(conversations(max_messages=8))
def test_the_next_turn_on_a_pd_pair_prefills_the_previous_reply_again(conv: Conversation) -> None:
    """The decode server keeps no occurrence tree, so the next turn is planned on the prefill server,
    whose tree lacks the reply: each turn computes exactly the previous reply's tokens that had KV
    (its length less one) more than on one server, whatever the drops and repositions."""
    single, pd = _computed_per_turn(conv, pd=False), _computed_per_turn(conv, pd=True)
    assert pd[0] == single[0]
    for turn in range(1, conv.n_turns):
        assert pd[turn] - single[turn] == len(conv.messages[turn]) - 1, f"turn {turn}"
