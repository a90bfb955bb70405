"""AKV's Prometheus counters, next to SGLang's own (``--enable-metrics``; scheduler process).

Per context request, counted once when it is first committed (a re-admission after a retraction
is not a new request): the request, its Drop and Repos events, the tokens it read through
re-rotated copies, and the *recovered* tokens: prompt tokens before its last cache operation that
had to be prefilled because their KV (as those tokens originally saw the context) was not resident.
Per prefill (each admission, once its last round is planned): its forwards, the prompt tokens it
computed (new), read as stored (cached) and read through re-rotated copies (repositioned), the copy
slots it allocated, and the scheduler's host time planning it (commit and forward metadata); the
same numbers in one debug log line. Per eviction: the KV slots the AKV tree freed. Per finished
context request: the host seconds its admission took (matching and planning against the tree,
locking, committing). Per launch of an AKV Triton kernel in a specialization not launched before in
the process: one first launch (compiled then; :mod:`akv.system.adapter.warmup` makes them all at start).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from akv.system.adapter.warmup import SHAPES
from akv.system.context.program import EventKind

PREFIX = "sglang:akv_"
logger = logging.getLogger(__name__)


_COUNTERS = {
    "context_requests": "Requests with drop_message/reposition.",
    "drops": "Drop events of context requests.",
    "repositions": "Repos events of context requests.",
    "rerotated_tokens": "Tokens read through re-rotated KV copies.",
    "recovered_tokens": "Prompt tokens before a request's last cache operation that were prefilled.",
    "evicted_tokens": "KV slots freed by the AKV tree's eviction.",
    "admission_seconds": "Host seconds of context requests' admission (match, plan, lock, commit).",
    "kernel_first_launches": "Launches of an AKV Triton kernel in a specialization new to the process.",
    "prefill_forwards": "Prefill forwards of context requests.",
    "prefill_new_tokens": "Prompt tokens context requests' prefills computed.",
    "prefill_cached_tokens": "Prompt tokens context requests' prefills read as stored.",
    "prefill_repositioned_tokens": "Prompt tokens context requests' prefills read through re-rotated copies.",
    "prefill_copy_slots": "KV slots allocated for re-rotated copies by context requests' prefills.",
    "prefill_host_seconds": "Scheduler host time planning context requests' prefills (commit, forward metadata).",
}


@cache
def _families() -> dict[str, Any]:
    """One Prometheus family per counter and process (after SGLang set PROMETHEUS_MULTIPROC_DIR)."""
    from prometheus_client import Counter

    return {name: Counter(f"{PREFIX}{name}_total", text, labelnames=("model_name",)) for name, text in _COUNTERS.items()}


class AkvMetrics:
    """The counters of one served model; a no-op without ``--enable-metrics``."""

    def __init__(self, enabled: bool, model_name: str = "") -> None:
        self.enabled = enabled
        if enabled:
            for name, family in _families().items():
                setattr(self, name, family.labels(model_name=model_name))
            self.kernel_first_launches.inc(SHAPES.first_launches)
            SHAPES.on_first = self.kernel_first_launches.inc

    def admitted(self, program: Any, plan: Any) -> None:
        """A context request's first commit: its program and the plan it runs."""
        if not self.enabled:
            return
        kinds = [event.kind for event in program.events]
        self.context_requests.inc()
        self.drops.inc(kinds.count(EventKind.DROP))
        self.repositions.inc(kinds.count(EventKind.REPOS))
        self.rerotated_tokens.inc(plan.usage.repos_tokens)
        last = program.events[-1].at if program.events else 0
        self.recovered_tokens.inc(int(np.count_nonzero(plan.computed[:last])))

    def finished(self, admission_seconds: float) -> None:
        """A context request finished (or was aborted) after ``admission_seconds`` of admission."""
        if self.enabled:
            self.admission_seconds.inc(admission_seconds)

    def evicted(self, n_slots: int) -> None:
        if self.enabled and n_slots:
            self.evicted_tokens.inc(n_slots)

    def prefilled(self, rid: str, plan: Any, stats: PrefillStats) -> None:
        """A context request's prefill is planned to its last round: ``plan`` (its ``RequestPlan``)."""
        new = int(np.count_nonzero(plan.computed))
        copies = sum(job.size for job in plan.copies)
        logger.debug("AKV prefill %s: forwards=%d new=%d cached=%d repositioned=%d copy_slots=%d host_ms=%.3f",
                     rid, stats.forwards, new, plan.usage.cached_tokens, plan.usage.repos_tokens, copies,
                     stats.host_seconds * 1e3)
        if not self.enabled:
            return
        self.prefill_forwards.inc(stats.forwards)
        self.prefill_new_tokens.inc(new)
        self.prefill_cached_tokens.inc(plan.usage.cached_tokens)
        self.prefill_repositioned_tokens.inc(plan.usage.repos_tokens)
        self.prefill_copy_slots.inc(copies)
        self.prefill_host_seconds.inc(stats.host_seconds)


@dataclass
class PrefillStats:
    """One admission's prefill so far: forwards planned and scheduler host time spent on it."""

    forwards: int = 0
    host_seconds: float = 0.0


def note_round(req: Any, state: Any, end: int, host_seconds: float, metrics: AkvMetrics) -> None:
    """A prefill round of ``req`` (``AkvRequest`` ``state``) up to column ``end`` was planned in
    ``host_seconds``; the last one reports the prefill."""
    stats: PrefillStats = req.akv_prefill
    stats.forwards += 1
    stats.host_seconds += host_seconds
    if end == state.program.n_tokens:
        metrics.prefilled(req.rid, state.active.plan, stats)
