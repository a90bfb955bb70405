"""AKV's Prometheus counters, next to SGLang's own (``--enable-metrics``; scheduler process).

Per context request, counted once when it is first committed (a re-admission after a retraction
is not a new request): the request, its Drop and Repos events, the tokens it read through
re-rotated copies, and the *recovered* tokens: prompt tokens before its last cache operation that
had to be prefilled because their KV (as those tokens originally saw the context) was not resident.
Per eviction: the KV slots the AKV tree freed. Per release of a context request (finished, aborted
or retracted), for its admission since the last one: the host seconds its admission took (matching
and planning against the tree, locking, committing), and its prefill: forwards, the prompt tokens it
computed (new), read as stored (cached) or through re-rotated copies (repositioned), the copy slots
it allocated, and where its time went (:mod:`akv.system.adapter.prefill_timing`: queue wait, rounds,
forward and copy device time, forward-metadata host time); the same numbers in one debug log line.
Per launch of an AKV Triton kernel in a specialization not launched before in
the process: one first launch (compiled then; :mod:`akv.system.adapter.warmup` makes them all at start).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import numpy as np

from akv.system.adapter.prefill_timing import PrefillStats
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
    "prefill_forwards": "Prefill forwards that carried context requests (a forward counts once per request).",
    "prefill_new_tokens": "Prompt tokens context requests' prefills computed.",
    "prefill_cached_tokens": "Prompt tokens context requests' prefills read as stored.",
    "prefill_repositioned_tokens": "Prompt tokens context requests' prefills read through re-rotated copies.",
    "prefill_copy_slots": "KV slots allocated for re-rotated copies by context requests' prefills.",
    "prefill_in_place_tokens": ("KV entries context requests' prefills re-rotated in their own slots (resident "
                                "versions, and their own births where copies would not fit)."),
    "prefill_wait_seconds": "Seconds context requests waited in the queue before admission.",
    "prefill_rounds_seconds": "Seconds from a context request's first prefill round to its last.",
    "prefill_forward_seconds": "Device seconds of the prefill forwards that carried context requests (per request).",
    "prefill_copy_seconds": "Device seconds of re-rotation copies in those forwards (per request).",
    "prefill_host_seconds": "Scheduler host seconds building context requests' prefill forward metadata.",
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

    def evicted(self, n_slots: int) -> None:
        if self.enabled and n_slots:
            self.evicted_tokens.inc(n_slots)

    def released(self, rid: str, state: Any) -> None:
        """A context request (``AkvRequest`` ``state``) is released (finished, aborted or retracted):
        its admission seconds and its prefill's breakdown since its last release
        (:mod:`akv.system.adapter.prefill_timing`), counted and in one debug log line; both restart."""
        stats, admission_s = state.prefill, state.admission_s
        state.prefill, state.admission_s = PrefillStats(), 0.0
        if self.enabled:
            self.admission_seconds.inc(admission_s)
        if stats.forwards == 0 or state.active is None:
            return
        plan = state.active.plan
        new = int(np.count_nonzero(plan.computed))
        in_place = sum(int(np.count_nonzero(job.src == job.dst)) for job in plan.copies)
        copies = sum(job.size for job in plan.copies) - in_place
        forward_s, copy_s = stats.device_seconds() if self.timing() else (0.0, 0.0)
        logger.debug("AKV prefill %s: forwards=%d new=%d cached=%d repositioned=%d copy_slots=%d in_place=%d "
                     "wait_ms=%.3f rounds_ms=%.3f forward_ms=%.3f copy_ms=%.3f host_ms=%.3f admission_ms=%.3f", rid,
                     stats.forwards, new, plan.usage.cached_tokens, plan.usage.repos_tokens, copies, in_place,
                     stats.wait_s * 1e3, stats.rounds_s * 1e3, forward_s * 1e3, copy_s * 1e3, stats.host_s * 1e3,
                     admission_s * 1e3)
        if not self.enabled:
            return
        for name, value in (("forwards", stats.forwards), ("new_tokens", new), ("cached_tokens", plan.usage.cached_tokens),
                            ("repositioned_tokens", plan.usage.repos_tokens), ("copy_slots", copies),
                            ("in_place_tokens", in_place), ("wait_seconds", stats.wait_s),
                            ("rounds_seconds", stats.rounds_s),
                            ("forward_seconds", forward_s), ("copy_seconds", copy_s), ("host_seconds", stats.host_s)):
            getattr(self, f"prefill_{name}").inc(value)

    def timing(self) -> bool:
        """Whether prefill forwards are timed: something reads the times (metrics, the DEBUG log)."""
        return self.enabled or logger.isEnabledFor(logging.DEBUG)
