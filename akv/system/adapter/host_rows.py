"""Each request's ``req_to_token`` row kept on the host, so that the radix backend publishes a
request's KV without reading the device back.

SGLang's overlap scheduler makes its schedule stream wait for the forward it just launched; a
blocking device read on that stream (result processing, the next batch's scheduling) waits for
that forward and leaves the GPU idle while the next batch is prepared. The slots SGLang allocates
for a forward are copied to pinned host memory when they are allocated, before that launch, and
read when the request is published, by which time the copy has long completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_RESOLVE_AT = 32
"""Pending copies a row keeps before applying those already done (one per decode step)."""


class _Copy:
    """The slots of one allocation on their way to the host: ``host`` once ``done`` (None: already
    on the host) has completed; every request of the allocation reads them from here."""

    __slots__ = ("host", "done", "_values")

    def __init__(self, host: torch.Tensor, done: Any) -> None:
        self.host = host
        self.done = done
        self._values: np.ndarray | None = None

    def values(self, wait: bool) -> np.ndarray | None:
        """The slots (without ``wait``: None while the copy is in flight)."""
        if self._values is None:
            if self.done is not None:
                if not wait and not self.done.query():
                    return None
                self.done.synchronize()
            self._values = self.host.numpy()
        return self._values


@dataclass
class HostRow:
    """A request's ``req_to_token`` columns ``[0, n_known)`` on the host, some still in flight:
    ``pending`` (copy, offset, n, column): the copy's ``[offset, offset + n)`` go to columns
    ``column ...``, in allocation order."""

    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    n_known: int = 0
    pending: list[tuple[_Copy, int, int, int]] = field(default_factory=list)

    def set(self, column: int, values: np.ndarray) -> None:
        """Columns ``column ...`` hold ``values`` (host slots); later columns are forgotten."""
        self._resolve()
        self._write(column, values)
        self.n_known = column + values.size

    def expect(self, copy: _Copy, offset: int, n: int, column: int) -> None:
        """Columns ``column ...`` get ``copy``'s ``[offset, offset + n)`` once it arrives."""
        self.pending.append((copy, offset, n, column))
        if len(self.pending) >= _RESOLVE_AT:
            self._resolve(only_done=True)

    def get(self, length: int) -> np.ndarray:
        """Columns ``[0, length)``: every one of them written by :meth:`set` or an allocation."""
        self._resolve()
        if length > self.n_known:
            raise RuntimeError(f"length: {length} columns asked, {self.n_known} known on the host")
        return self.slots[:length].copy()

    def _grow(self, n: int) -> None:
        if n > self.slots.size:
            grown = np.zeros(max(n, 2 * self.slots.size), dtype=np.int64)
            grown[: self.slots.size] = self.slots
            self.slots = grown

    def _write(self, column: int, values: np.ndarray) -> None:
        end = column + values.size
        self._grow(end)
        self.slots[column:end] = values
        self.n_known = max(self.n_known, end)

    def _write_columns(self, single: dict[int, int]) -> None:
        """Write ``column -> slot`` (one slot per column) at once, and forget them."""
        if single:
            columns = np.fromiter(single, dtype=np.int64, count=len(single))
            end = int(columns.max()) + 1
            self._grow(end)
            self.slots[columns] = np.fromiter(single.values(), dtype=np.int64, count=len(single))
            self.n_known = max(self.n_known, end)
            single.clear()

    def _resolve(self, only_done: bool = False) -> None:
        """Apply the pending copies in order (with ``only_done``, up to the first still in flight);
        consecutive single-slot copies (decode steps) are written together, the latest per column."""
        single: dict[int, int] = {}
        n = 0
        for copy, offset, count, column in self.pending:
            values = copy.values(wait=not only_done)
            if values is None:
                break
            if count == 1:
                single[column] = values[offset]
            else:
                self._write_columns(single)
                self._write(column, values[offset : offset + count])
            n += 1
        self._write_columns(single)
        del self.pending[:n]


def row_of(req: Any) -> HostRow:
    """The request's host row (made empty on first use)."""
    row = getattr(req, "akv_row", None)
    if row is None:
        row = req.akv_row = HostRow()
    return row


def record(reqs: list[Any], columns: list[int], counts: list[int], out_cache_loc: torch.Tensor) -> None:
    """Request ``i`` was given ``out_cache_loc``'s next ``counts[i]`` slots at columns
    ``columns[i] ...``: queue their copy to the host on the current stream."""
    if out_cache_loc.device.type == "cpu":
        host, done = out_cache_loc.to(torch.int64), None
    else:
        host = torch.empty(out_cache_loc.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(out_cache_loc, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    copy = _Copy(host, done)
    offset = 0
    for req, column, n in zip(reqs, columns, counts):
        row_of(req).expect(copy, offset, n, column)
        offset += n
