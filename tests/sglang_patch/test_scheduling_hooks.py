"""The scheduler-side hooks (``akv.system.adapter.scheduling``) on stand-in requests: which context
requests are refused up front with a 400 message naming the field, and how rounds stop at segment
ends. (SGLang's real scheduler drives the same hooks in tests/sglang_cpu.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.scheduling import attach, cap_extend, hold_rounds, must_wait
from akv.system.cache.occurrence import cold_plan
from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules
from akv.system.context.wire import encode_program

SERVER = SimpleNamespace(radix_cache_backend="akv", chunked_prefill_size=64)


def program(lengths: list[int], drop: dict | None = None, repos: list[int] | None = None):
    ids = np.arange(sum(lengths), dtype=np.int64) % 97
    owners = np.repeat(np.arange(len(lengths)), lengths)
    n = len(lengths) - 1
    return compile_program(ids, owners, parse_rules(drop, repos, n), n)


def request(prog) -> tuple[SimpleNamespace, SimpleNamespace]:
    req = SimpleNamespace(origin_input_ids=prog.token_ids.tolist(), extra_key=None, akv=None)
    return req, SimpleNamespace(context_program=encode_program(prog))


def test_a_servable_program_is_attached() -> None:
    prog = program([5, 6, 7, 2], {"2": [1]}, [2])
    req, recv = request(prog)
    assert attach(req, recv, SERVER, pool_size=1000) is None
    assert isinstance(req.akv, AkvRequest) and req.akv.program.n_tokens == prog.n_tokens


def test_a_plain_request_is_left_alone() -> None:
    req = SimpleNamespace(akv=None)
    assert attach(req, SimpleNamespace(context_program=None), SERVER, pool_size=10) is None and req.akv is None


@pytest.mark.parametrize(
    ("server", "mangle", "message"),
    [
        (SimpleNamespace(radix_cache_backend=None, chunked_prefill_size=64), None,
         "server configuration: radix_cache_backend None cannot execute"),
        (SimpleNamespace(radix_cache_backend="akv", chunked_prefill_size=-1), None, "need chunked prefill"),
        (SERVER, lambda b: b[:-1] + bytes([b[-1] ^ 1]), "context_program: digest"),
        (SERVER, "tokens", "context_program: its tokens differ"),
    ],
)
def test_unservable_requests_are_refused(server, mangle, message) -> None:
    req, recv = request(program([5, 6, 2], {"1": [0]}))
    if mangle == "tokens":
        req.origin_input_ids = req.origin_input_ids[::-1]
    elif mangle is not None:
        recv.context_program = mangle(recv.context_program)
    error = attach(req, recv, server, pool_size=1000)
    assert error is not None and message in error and req.akv is None


def test_kv_that_can_never_fit_is_refused_with_the_exact_cold_need() -> None:
    """A reposition after a drop re-rotates what follows the gap: births plus copies can exceed the
    pool although the prompt alone fits. The limit is the cold plan's own count."""
    prog = program([30, 30, 30, 2], {"2": [0]}, [2])
    need = cold_plan(prog).n_slots
    cold = CacheCore(SlotPool(1000)).admit(prog)
    assert need == cold.plan.fresh.size and need > prog.n_tokens
    req, recv = request(prog)
    error = attach(req, recv, SERVER, pool_size=need - 1)
    assert error == f"messages: the prompt needs {need} KV slots with its re-rotated copies, more than the {need - 1} this server holds"
    req, recv = request(prog)
    assert attach(req, recv, SERVER, pool_size=need) is None


def test_rounds_stop_at_segment_ends_and_continue_beside_the_chunked_slot() -> None:
    prog = program([4, 4, 4, 2], {"2": [0]}, [2])
    req, recv = request(prog)
    attach(req, recv, SERVER, pool_size=1000)
    state = req.akv
    core = CacheCore(SlotPool(1000))
    state.plan_draft(core)
    segments = state.plan_draft_segments()
    assert len(segments) == 2 and state.needs_rounds()
    req.full_untruncated_fill_ids = list(prog.token_ids)
    req.set_extend_range = lambda lo, hi: setattr(req, "extend_range", SimpleNamespace(start=lo, end=hi))
    req.set_extend_range(0, prog.n_tokens)
    assert cap_extend(req) and req.extend_range.end == segments[0].end
    req.prefix_indices = []
    first = segments[0].end - segments[0].start
    idle = SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=64, akv_new_rounds=[])
    assert not must_wait(idle, req, has_chunked_req=False)
    hold_rounds(idle, req, has_chunked_req=False)
    assert idle.new_chunked_req is req and idle.akv_new_rounds == []  # the free slot takes it
    taken = SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=first, akv_new_rounds=[])
    assert not must_wait(taken, req, has_chunked_req=True)  # its first round fits: it joins
    hold_rounds(taken, req, has_chunked_req=True)
    assert taken.new_chunked_req is None and taken.akv_new_rounds == [req]  # and continues beside the slot
    assert must_wait(SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=first - 1), req,
                     has_chunked_req=True)  # its first round does not fit what is left
    short = SimpleNamespace(akv=None, full_untruncated_fill_ids=[1] * 8, prefix_indices=[])
    with_context = SimpleNamespace(new_chunked_req=req, can_run_list=[req], rem_chunk_tokens=64)
    assert not must_wait(with_context, short, has_chunked_req=False)  # its whole prefill fits: it joins
    assert must_wait(SimpleNamespace(new_chunked_req=req, can_run_list=[req], rem_chunk_tokens=4), short,
                     has_chunked_req=False)  # SGLang would have to chunk it: it waits
    plain_chunked = SimpleNamespace(akv=None)
    assert not must_wait(SimpleNamespace(new_chunked_req=None, can_run_list=[plain_chunked], rem_chunk_tokens=4),
                         short, has_chunked_req=True)  # plain traffic keeps SGLang's own path
