"""AKV's Prometheus counters: what an operator reads next to SGLang's metrics."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest

from akv.system.adapter.metrics import AkvMetrics
from akv.system.adapter.prefill_timing import ForwardTimer, PrefillStats
from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules

prometheus = pytest.importorskip("prometheus_client")


def _value(name: str, model: str) -> float:
    return prometheus.REGISTRY.get_sample_value(f"sglang:akv_{name}", {"model_name": model}) or 0.0


MESSAGES = ((1, 2, 3), (4, 5, 6, 7), (8, 9), (10, 11), (12,))


def _program(last: int):
    """Messages ``0..last``; message 1 dropped and the rest repositioned after message 2."""
    ids = [t for m in MESSAGES[: last + 1] for t in m]
    owners = [i for i, m in enumerate(MESSAGES[: last + 1]) for _ in m]
    rules = parse_rules({"2": [1]}, [2], last + 1)
    return compile_program(np.array(ids, dtype=np.int64), np.array(owners, dtype=np.int64), rules, last + 1)


def test_counters_follow_the_requests_served() -> None:
    metrics = AkvMetrics(True, model_name="counted")
    core = CacheCore(SlotPool(256))
    first = _program(3)
    active = core.admit(first)
    metrics.admitted(first, active.plan)
    # cold: every token up to the last event (after message 2: 3 + 4 + 2 tokens) was prefilled
    assert _value("context_requests_total", "counted") == 1
    assert _value("drops_total", "counted") == 1 and _value("repositions_total", "counted") == 1
    assert _value("recovered_tokens_total", "counted") == 9
    assert _value("rerotated_tokens_total", "counted") == 0
    core.finish(active, np.array([12], dtype=np.int64), core.allocate(1))

    second = _program(4)
    active = core.admit(second)
    metrics.admitted(second, active.plan)
    # warm: the history is resident, nothing before the last event is prefilled again; the reply
    # tokens after the reposition read re-rotated KV exactly when the core reports it
    assert _value("context_requests_total", "counted") == 2
    assert _value("recovered_tokens_total", "counted") == 9
    assert _value("rerotated_tokens_total", "counted") == active.plan.usage.repos_tokens
    core.abort(active)

    metrics.evicted(5)
    metrics.evicted(0)
    assert _value("evicted_tokens_total", "counted") == 5


def test_disabled_metrics_register_nothing() -> None:
    metrics = AkvMetrics(False, model_name="silent")
    metrics.evicted(3)
    assert _value("evicted_tokens_total", "silent") == 0


def _forward(seconds: float, *copies: float) -> ForwardTimer:
    """A CPU forward timer whose forward and copy intervals lasted the given seconds."""
    timer = ForwardTimer("cpu")
    timer.forward.marks = [10.0, 10.0 + seconds]
    for c in copies:
        timer.copy().marks = [10.0, 10.0 + c]
    return timer


def test_a_release_reports_the_prefills_forwards_tokens_and_where_its_time_went(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = AkvMetrics(True, model_name="prefills")
    core = CacheCore(SlotPool(256))
    prog = _program(3)
    state = SimpleNamespace(program=prog, active=core.admit(prog), prefill=PrefillStats(), admission_s=0.004)
    state.prefill.admitted(time.perf_counter() - 0.5)  # entered the queue half a second ago
    state.prefill.round(0.002, False, _forward(0.25, 0.125))  # a round before the prompt's end
    state.prefill.round(0.003, True, _forward(0.5))
    copy_slots = state.active.plan.fresh.size - prog.n_tokens  # cold: a birth per prompt token, the rest copies
    assert copy_slots > 0
    with caplog.at_level(logging.DEBUG, logger="akv.system.adapter.metrics"):
        metrics.released("r1", state)
    assert _value("prefill_forwards_total", "prefills") == 2
    assert _value("prefill_new_tokens_total", "prefills") == prog.n_tokens  # cold: every prompt token computed
    assert _value("prefill_cached_tokens_total", "prefills") == 0
    assert _value("prefill_repositioned_tokens_total", "prefills") == 0
    assert _value("prefill_copy_slots_total", "prefills") == copy_slots
    assert _value("prefill_host_seconds_total", "prefills") == pytest.approx(0.005)
    assert _value("prefill_forward_seconds_total", "prefills") == pytest.approx(0.75)
    assert _value("prefill_copy_seconds_total", "prefills") == pytest.approx(0.125)
    assert _value("admission_seconds_total", "prefills") == pytest.approx(0.004)
    assert 0.5 <= _value("prefill_wait_seconds_total", "prefills") < 60
    assert 0 < _value("prefill_rounds_seconds_total", "prefills") < _value("prefill_wait_seconds_total", "prefills")
    assert f"AKV prefill r1: forwards=2 new={prog.n_tokens} cached=0 repositioned=0 copy_slots={copy_slots} " \
           in caplog.text
    assert "forward_ms=750.000 copy_ms=125.000 host_ms=5.000 admission_ms=4.000" in caplog.text
    # counted once: the request's next release (after a retraction, say) starts from nothing
    assert state.prefill.forwards == 0 and state.admission_s == 0
    metrics.released("r1", state)
    assert _value("prefill_forwards_total", "prefills") == 2
    assert _value("admission_seconds_total", "prefills") == pytest.approx(0.004)


def test_a_prefill_in_one_forward_spends_no_time_between_rounds() -> None:
    stats = PrefillStats()
    stats.round(0.001, True, None)
    assert stats.forwards == 1 and stats.rounds_s == 0


def test_forwards_are_timed_only_when_something_reads_the_times() -> None:
    assert AkvMetrics(True, model_name="timed").timing()
    assert not AkvMetrics(False, model_name="untimed").timing()  # the logger is at its default level
