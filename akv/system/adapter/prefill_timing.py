"""Where a context request's prefill time goes, counted per request from its admission until it is
released (finished, aborted or retracted; :meth:`akv.system.adapter.metrics.AkvMetrics.released`):

- ``wait``: seconds in SGLang's waiting queue before its admission (memory, room in the batch, the
  chunked-request slot);
- ``rounds``: seconds from its first prefill round's planning to its last one's (0 when it prefills
  in one forward): the scheduling steps its KV waited, locked, between rounds;
- ``forwards``: the prefill forwards that carried it, and their ``forward`` device seconds (whole
  forwards, shared with the other requests of their batch);
- ``copy``: device seconds of the re-rotation copies run inside those forwards;
- ``host``: scheduler host seconds building its rounds' forward metadata (births, attention
  entries, copy jobs). Admission (match, plan, lock, commit) is ``AkvRequest.admission_s``.

Device time is measured only while something reads it (metrics on, or the DEBUG log): CUDA events
on the forward stream, read once the request is released (its forwards are done by then); host
clock readings on other devices, whose forwards run synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


class Interval:
    """A start and an end mark on one device."""

    def __init__(self, device: Any) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        """The start, then the end (on the current stream under CUDA)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> float:
        """Seconds between the marks (0 if the interval was never closed)."""
        if len(self.marks) < 2:
            return 0.0
        start, end = self.marks[0], self.marks[1]
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


class ForwardTimer:
    """One prefill forward's interval and those of the copies it runs."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.forward = Interval(device)
        self.copies: list[Interval] = []

    def copy(self) -> Interval:
        """A new copy interval of this forward."""
        interval = Interval(self.device)
        self.copies.append(interval)
        return interval


def forward_mark(forward_batch: Any) -> None:
    """Mark the start, then the end, of a forward that carries a timer (``ModelRunner.forward``)."""
    akv = getattr(forward_batch, "akv", None)
    timer = getattr(akv, "timer", None)
    if timer is not None:
        timer.forward.mark()


@dataclass
class PrefillStats:
    """One context request's prefill so far (since its last release)."""

    forwards: int = 0
    host_s: float = 0.0
    wait_s: float = 0.0
    rounds_s: float = 0.0
    first_round_at: float | None = None
    timers: list[ForwardTimer] = field(default_factory=list)

    def admitted(self, queued_at: float) -> None:
        """Admitted now, having entered the waiting queue at ``queued_at`` (``time.perf_counter``;
        0 when SGLang did not record it)."""
        if queued_at > 0:
            self.wait_s += max(time.perf_counter() - queued_at, 0.0)

    def round(self, host_s: float, last: bool, timer: ForwardTimer | None) -> None:
        """One prefill round planned in ``host_s``; ``last`` when it reaches the prompt's end."""
        now = time.perf_counter()
        if self.first_round_at is None:
            self.first_round_at = now
        self.forwards += 1
        self.host_s += host_s
        if timer is not None:
            self.timers.append(timer)
        if last:
            self.rounds_s += now - self.first_round_at
            self.first_round_at = None

    def device_seconds(self) -> tuple[float, float]:
        """``(forward, copy)`` device seconds of the forwards timed."""
        forward = sum(t.forward.seconds() for t in self.timers)
        return forward, sum(c.seconds() for t in self.timers for c in t.copies)
