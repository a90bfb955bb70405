"""Prefill–decode disaggregation of context requests: what the prefill server sends, what the decode
server allocates, at which positions it generates, and the usage it reports without computing it.

The prefill server runs the whole plan (drops, re-rotations, recovered segments). Generation reads only
the plan's terminal view: the kept tokens in column order, K rotated at their final positions, after
the terminal copies. That is all it sends, in that order; with page size 1 (AKV's) a slot is a page.
The decode server holds them as columns ``0 .. V-1`` of its ``req_to_token`` row, where ``V`` is the
kept count (not the prompt's length), and every column is visible to it. Its generated column
``c >= V`` is at position ``c + next_position - V``: after a Drop without a Repos the kept keys keep
their gapped positions, so ``next_position`` differs from ``V``.

Both servers compile the same program from the same request body, so the decode server knows ``V``
and ``next_position`` before the KV arrives (it allocates ``V`` slots then). The usage counters depend
on the prefill server's cache, so they travel in the spare int32 columns of SGLang's per-request
``cached_tokens`` metadata row (SGLang uses columns 0–6), with ``V`` and ``next_position`` as a check
that both sides compiled the same program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.system.adapter.context_request import AkvRequest
from akv.system.arrays import frozen
from akv.system.cache.plan import CopyJob, Usage
from akv.system.context.program import ContextProgram

METADATA_COLUMNS = range(7, 14)
"""Columns of the ``cached_tokens`` metadata row (16 int32 per request) this module writes: a marker,
``V``, ``next_position`` and the four usage counters."""

CONTEXT_MARKER = 0x414B56  # "AKV": the row describes a context request
INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class DecodeLayout:
    """A context request on the decode server: ``visible`` received columns (all visible), then
    generated columns, column ``c >= visible`` at position ``c + offset``."""

    visible: int
    next_position: int

    @classmethod
    def of(cls, program: ContextProgram) -> DecodeLayout:
        return cls(visible=int(np.count_nonzero(program.keep)), next_position=int(program.next_position))

    @property
    def offset(self) -> int:
        return self.next_position - self.visible


@dataclass(frozen=True)
class PrefillSend:
    """What the prefill server sends for one context request, once its last prefill round ran: run
    ``copies`` (the terminal re-rotations, None if none), then send ``slots`` (prefill-side slots of
    program columns ``tokens``) in order, into the decode side's columns ``0 .. V-1``."""

    tokens: np.ndarray
    slots: np.ndarray
    copies: CopyJob | None
    layout: DecodeLayout
    usage: Usage

    @property
    def metadata(self) -> PdMetadata:
        return PdMetadata(self.layout, self.usage)


def prefill_send(state: AkvRequest) -> PrefillSend:
    """The send list of a committed context request whose births are all bound."""
    tokens, slots, copies = state.terminal()
    layout = DecodeLayout.of(state.program)
    if tokens.size != layout.visible:
        raise RuntimeError(f"AKV: terminal view has {tokens.size} columns, the program keeps {layout.visible}")
    assert state.first_usage is not None  # set by commit
    return PrefillSend(frozen(tokens, np.int64), frozen(slots, np.int64), copies, layout, state.first_usage)


@dataclass(frozen=True)
class PdMetadata:
    """The context-request part of the prefill→decode metadata row."""

    layout: DecodeLayout
    usage: Usage

    def columns(self) -> tuple[int, ...]:
        """Values of :data:`METADATA_COLUMNS`, in order."""
        u = self.usage
        values = (CONTEXT_MARKER, self.layout.visible, self.layout.next_position, u.cached_tokens,
                  u.repos_tokens, u.drop_skipped_tokens, u.computed_tokens)
        if any(not 0 <= v <= INT32_MAX for v in values):
            raise ValueError(f"metadata: {values} do not fit int32")
        return values

    def write(self, row: Any) -> None:
        """Write into one request's ``cached_tokens`` row (a numpy array or a CPU tensor of 16 int32)."""
        for column, value in zip(METADATA_COLUMNS, self.columns()):
            row[column] = value

    @classmethod
    def read(cls, row: Any) -> PdMetadata | None:
        """The metadata in ``row``, or None when the row carries none (no AKV prefill server wrote it)."""
        values = [int(row[c]) for c in METADATA_COLUMNS]
        if values[0] != CONTEXT_MARKER:
            return None
        visible, next_position, cached, repos, skipped, computed = values[1:]
        return cls(DecodeLayout(visible, next_position), Usage(cached, repos, skipped, computed))


def check_received(expected: DecodeLayout, received: PdMetadata | None) -> str | None:
    """Why the decode server must not serve what arrived (None when it may): the prefill server sent
    a plain request's row, or compiled another program (another ``V`` or ``next_position``)."""
    if received is None:
        return "server configuration: the prefill server did not send context-request metadata (is it the AKV build?)"
    if received.layout != expected:
        return (f"server configuration: the prefill server sent V={received.layout.visible}, next_position="
                f"{received.layout.next_position}; this server compiled V={expected.visible}, "
                f"next_position={expected.next_position}")
    return None
