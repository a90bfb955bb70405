"""Prefix keys: the records (tokens and cache events) a request's KV depends on, as int64 arrays.

A token record is the token id (>= 0). Event records are negative, so identical text with a
different drop/reposition history stops matching at the first differing record, and a request
without events has exactly the plain token-id key (the ordinary namespace, as in SGLang's RadixKey):

- Drop: ``DROP_OPEN, -(start + BOUND_BASE), -(end + BOUND_BASE), ..., DROP_CLOSE`` per hidden range;
- Repos: ``REPOS``.

A token's position is not stored: it is a function of the records before it. Events that change
nothing (a Drop hiding no token, a Repos with no Drop since the previous Repos) produce no record,
because the KV after them is the same as without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from akv.system.arrays import frozen
from akv.system.context.program import ContextProgram, EventKind

DROP_OPEN = -1
REPOS = -2
DROP_CLOSE = -3
BOUND_BASE = 8


class CacheKeyError(ValueError):
    """A key cannot be built or extended; the message names the field and value."""


@dataclass(frozen=True)
class RecordKey:
    """One request's prefix key: ``records`` (int64) and the record index of every token; ``base``: the
    key it extends (:meth:`with_tokens`), whose records begin its own."""

    records: np.ndarray
    token_record: np.ndarray
    namespace: str = ""
    base: RecordKey | None = field(default=None, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return int(self.token_record.shape[0])

    def tokens_within(self, n_records: int) -> int:
        """How many tokens have their record (and hence their whole history) in ``records[:n_records]``."""
        return int(np.searchsorted(self.token_record, n_records, side="left"))

    def with_tokens(self, token_ids: np.ndarray) -> RecordKey:
        """This key followed by appended tokens (generated at the final stage, no further events)."""
        ids = _token_ids(token_ids)
        start = self.records.shape[0]
        return RecordKey(
            records=frozen(np.concatenate([self.records, ids]), np.int64),
            token_record=frozen(np.concatenate([self.token_record, np.arange(start, start + ids.size)]), np.int64),
            namespace=self.namespace,
            base=self,
        )


def plain_key(token_ids: np.ndarray, namespace: str = "") -> RecordKey:
    """Key of a request without cache events: the token ids themselves."""
    ids = _token_ids(token_ids)
    return RecordKey(records=frozen(ids.copy(), np.int64), token_record=frozen(np.arange(ids.size), np.int64),
                     namespace=namespace)


def program_key(program: ContextProgram, namespace: str = "") -> RecordKey:
    """Key of a compiled program: its tokens with the effective events inserted where they apply."""
    at: list[int] = []
    inserted: list[int] = []
    lengths: list[int] = []
    gap = False
    for event in program.events:
        records = _event_records(event.kind, event.ranges, gap)
        gap = (gap or bool(event.ranges)) and event.kind is not EventKind.REPOS
        if records:
            at.append(event.at)
            lengths.append(len(records))
            inserted.extend(records)
    n = program.n_tokens
    where, sizes = np.asarray(at, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    before = np.concatenate([[0], np.cumsum(sizes)])  # records of the events before each run of tokens
    runs = np.diff(np.concatenate([[0], where, [n]]))  # events come in order: ``at`` never decreases
    token_record = np.arange(n, dtype=np.int64) + np.repeat(before, runs)
    records = np.empty(n + len(inserted), dtype=np.int64)
    records[token_record] = program.token_ids
    records[np.repeat(where, sizes) + np.arange(len(inserted), dtype=np.int64)] = inserted
    return RecordKey(records=frozen(records, np.int64), token_record=frozen(token_record, np.int64),
                     namespace=namespace)


def _event_records(kind: EventKind, ranges: tuple[tuple[int, int], ...], gap: bool) -> list[int]:
    """Records of one event; a Repos counts only when a Drop hid something since the last one."""
    if kind is EventKind.REPOS:
        return [REPOS] if gap else []
    if not ranges:
        return []
    return [DROP_OPEN, *(-(bound + BOUND_BASE) for pair in ranges for bound in pair), DROP_CLOSE]


def _token_ids(value: np.ndarray) -> np.ndarray:
    ids = np.asarray(value)
    if ids.ndim != 1:
        raise CacheKeyError(f"token_ids: expected a 1-D array, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise CacheKeyError(f"token_ids: expected integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    if ids.size and ids.min() < 0:
        bad = int(np.flatnonzero(ids < 0)[0])
        raise CacheKeyError(f"token_ids[{bad}]: negative token id {int(ids[bad])}")
    return ids

