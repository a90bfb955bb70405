"""One context request's AKV state inside SGLang's scheduler (held as ``Req.akv``).

SGLang sees the request as its program's tokens, one ``req_to_token`` column per token. A
chunked-prefill round over columns ``[lo, hi)`` may cover several contiguous segments (each its own
attention entry, :mod:`akv.system.adapter.batch_metadata`); it gets, as its prefix, the slots its
first segment ``s`` reads for the columns before ``lo`` (zeros where nothing is visible) and writes
its births into ``[lo, hi)``. Generation reads the terminal view, written into the row once before
the first decode step.

Plans are in-place plans (:mod:`akv.system.cache.occurrence`): a resident version that nothing but
this request reads (no other request, no other tree path, no earlier segment of the request) is
re-rotated in its own slot and published at its new position; a copy is taken only where the old
version must stay readable. A request's own births are copied too (all its segments run in one
forward), unless that would not leave room for its new tokens: then its births are re-rotated in
place as well, each such copy starting a new round, and if even that does not fit, a birth no later
round reads goes back to the pool before the next round, rounds cut so that each holds at most the
fewest births the request can hold (:mod:`akv.system.cache.lifetimes`). From its lock to its
commit those versions are set aside (:meth:`akv.system.cache.core.CacheCore.reserve`): a request
matched meanwhile does not read them at their old positions. A draft whose in-place version another
request holds is planned again (it copies that version).
"""

from __future__ import annotations

import time

import numpy as np

from akv.system.adapter.prefill_timing import PrefillStats
from akv.system.adapter.window_lists import segment_round_end
from akv.system.cache.core import ActiveRequest, CacheCore, Draft
from akv.system.cache.lifetimes import BirthLifetimes
from akv.system.cache.occurrence import resolve_births
from akv.system.cache.plan import CopyJob, Segment, Usage
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import append_generated
from akv.system.context.program import ContextProgram

VISIBLE_ALWAYS = np.iinfo(np.int32).max
"""``visible_until`` of a column every later query reads (kept tokens, generated tokens)."""


def _holds(draft: Draft, pool: SlotPool, room: int, births: int | None = None) -> int:
    """Slots a request planned by ``draft`` holds at its peak: births (all of them, else ``births``),
    copy slots and borrowed versions (counted once each only when listing them all would exceed
    ``room``)."""
    own = (draft.plan.n_births if births is None else births) + draft.n_copy_slots
    borrowed = draft.plan.plan.borrowed
    return own + (borrowed.size if own + borrowed.size <= room else pool.n_distinct(borrowed))


class AkvRequest:
    """Program, plan and progress of one context request; also its radix-cache lock handle."""

    def __init__(self, program: ContextProgram, namespace: str = "") -> None:
        self.base = program
        self.program = program
        self.namespace = namespace
        self.draft: Draft | None = None
        self._cold = False
        self._room: int | None = None
        self.lifetimes: BirthLifetimes | None = None  # set when the draft's births are recycled
        self._n_freed = 0  # births of lifetimes.by_death given back so far
        self.active: ActiveRequest | None = None
        self.first_usage: Usage | None = None
        self.pinned: np.ndarray | None = None
        self.reserved: np.ndarray | None = None  # the pinned versions it rotates in place
        self.locks = 0
        self.segment = 0
        self.terminal_written = False
        self._kept: tuple[ContextProgram, int] | None = None
        self._shared: tuple[Draft, tuple[Segment, ...]] | None = None
        self.window: int | None = None  # the model's sliding window, set by the radix cache
        self.admission_s = 0.0  # host seconds spent matching, planning, locking and committing
        self.prefill = PrefillStats()  # where its prefill's time went (reported and reset when released)

    # ---- planning -------------------------------------------------------------------------------

    def plan_draft(self, core: CacheCore, *, cold: bool = False, room: int | None = None) -> Draft:
        """The draft against the tree as it is now (recomputed only when the tree changed on its path,
        :meth:`akv.system.cache.core.CacheCore.current`, unless locked); ``cold`` plans every token as
        recomputed (SGLang's forced-miss test mode). ``room`` (kept for later calls): the most slots
        the request may hold (the pool less its new tokens and admission's slack). A draft that would
        hold more (what it borrows as well as its births and copies) is planned again with its births
        re-rotated in place, and if that still holds more, cold with its births in place; if none
        fits, the first of them whose births fit when each is given back once no later round reads it
        (:attr:`lifetimes`; the last, cold, always fits: :func:`akv.system.adapter.scheduling.attach`),
        else the request could never be admitted."""
        if room is not None:
            self._room = room
        if self.pinned is not None and self.draft is not None:
            return self.draft
        if (self.draft is None or cold != self._cold or not core.current(self.draft)
                or core.contested(self.draft) or core.reads_reserved(self.draft)):
            started = time.perf_counter()
            self.draft = self._fitting_draft(core, cold)
            self._cold = cold
            self.admission_s += time.perf_counter() - started
        return self.draft

    def _fitting_draft(self, core: CacheCore, cold: bool) -> Draft:
        """The first of the in-place plan, the same with births in place, and the cold one with births
        in place whose births fit the room; else whose births recycled (their slots given back once
        no later round reads them, rounds cut to hold :meth:`BirthLifetimes.single_peak`) fit it."""
        self.lifetimes = None
        tries = [{"cold": cold}, {"cold": cold, "births_in_place": True}]
        if not cold:
            tries.append({"cold": True, "births_in_place": True})
        drafts = []
        for kwargs in tries:
            drafts.append(core.match(self.program, self.namespace, in_place=True, **kwargs))
            if self._room is None or _holds(drafts[-1], core.pool, self._room) <= self._room:
                return drafts[-1]
        for draft in drafts:
            self.lifetimes = BirthLifetimes.of(draft.plan.plan, self.program.n_tokens)
            if _holds(draft, core.pool, self._room, self.lifetimes.single_peak()) <= self._room:
                return draft
        return draft

    def birth_peak(self) -> int:
        """Births the draft holds at once: all of them, or with recycling its fewest."""
        assert self.draft is not None
        return self.draft.plan.n_births if self.lifetimes is None else self.lifetimes.single_peak()

    def free_dead(self, core: CacheCore, column: int) -> None:
        """Before a round from ``column``: give back the births no round from there on reads (when
        the request recycles them)."""
        if self.lifetimes is not None and self.active is not None:
            dead = self.lifetimes.n_dead_before(column)
            core.free_births(self.active, self.lifetimes.by_death[self._n_freed : dead])
            self._n_freed = max(self._n_freed, dead)

    @property
    def first_start(self) -> int:
        """Columns SGLang treats as the matched prefix before the first round."""
        assert self.draft is not None
        return self.draft.plan.plan.segments[0].start

    def plan_draft_segments(self) -> tuple[Segment, ...]:
        """The draft's segments, copies named by the slot they will share (rounds are cut where a
        copy reuses a slot an earlier segment of the round reads)."""
        assert self.draft is not None
        if self._shared is None or self._shared[0] is not self.draft:  # asked at every scheduling step
            self._shared = (self.draft, self.draft.plan.shared_segments())
        return self._shared[1]

    def round_end(self, segment: Segment, lo: int, hi: int) -> int:
        """End of a round of ``segment`` from column ``lo``, at most ``hi``: where SGLang's sliding-window
        extend stops being exact (:func:`akv.system.adapter.window_lists.segment_round_end`)."""
        hi = min(hi, segment.end)
        return hi if self.window is None else segment_round_end(segment, lo, hi, self.window)

    def extra_budget(self) -> int:
        """Slots beyond SGLang's own extend count that admission must reserve: the copy slots."""
        return 0 if self.draft is None else self.draft.n_copy_slots

    def lock(self, core: CacheCore) -> None:
        """SGLang's lock: hold the versions the draft borrows, so admission counts them as taken
        and nothing evicts them before :meth:`commit` (which allocates the copy slots)."""
        if self.active is None and self.pinned is None:
            draft = self.plan_draft(core, cold=self._cold)
            started = time.perf_counter()
            self.pinned = draft.plan.plan.borrowed
            core.pool.incref(self.pinned)
            self.reserved = draft.plan.taken
            core.reserve(self.reserved)
            self.admission_s += time.perf_counter() - started

    def unlock(self, core: CacheCore, *, handed_over: bool = False) -> None:
        """Drop the lock (``handed_over``: its references now belong to the committed request)."""
        if self.pinned is not None:
            if not handed_over:
                core.pool.decref(self.pinned)
            core.unreserve(self.reserved)
            self.pinned = None

    def commit(self, core: CacheCore) -> None:
        """Take the borrowed versions for the request and allocate its copy slots (once), right
        before SGLang allocates the first round's births."""
        if self.active is not None:
            return
        held = self.pinned is not None
        draft = self.draft if held else self.plan_draft(core, cold=self._cold)
        assert draft is not None
        if core.contested(draft, held=held):  # a request matched before the lock reads the old version
            self.unlock(core)
            draft, held = self.plan_draft(core, cold=self._cold), False
        started = time.perf_counter()
        self.active = core.commit(draft, held=held, hand_over=True)
        self.unlock(core, handed_over=held)
        self.admission_s += time.perf_counter() - started
        self.segment = 0
        self._n_freed = 0
        self.terminal_written = False
        if self.first_usage is None:
            self.first_usage = self.active.plan.usage

    def release(self, core: CacheCore, generated_ids: np.ndarray | None = None,
                generated_slots: np.ndarray | None = None, *, publish: bool) -> None:
        """Finish (publish) or abort the committed request (or drop its lock, keeping its draft: SGLang
        locks a waiting request to check its budget and unlocks it when it must wait); the caller owns
        ``generated_slots``."""
        self.unlock(core)
        active, self.active, self.locks = self.active, None, 0
        if active is None:
            return
        self.draft = None
        if publish:
            core.finish(active, generated_ids, generated_slots)
        else:
            core.abort(active)

    def readmit(self, output_ids: list[int]) -> None:
        """After a retraction: the program grows by the tokens generated so far (usage stays the first)."""
        self.program = append_generated(self.base, np.asarray(output_ids, dtype=np.int64))
        self.draft = None

    # ---- rounds ---------------------------------------------------------------------------------

    @property
    def plan_segments(self) -> tuple[Segment, ...]:
        assert self.active is not None
        return self.active.plan.segments

    def current(self, lo: int) -> Segment:
        """The segment a round starting at column ``lo`` belongs to (advancing past finished ones)."""
        segments = self.plan_segments
        while segments[self.segment].end <= lo:
            self.segment += 1
        segment = segments[self.segment]
        if lo < segment.start:
            raise RuntimeError(f"AKV: round at column {lo} is before segment [{segment.start}, {segment.end})")
        return segment

    def next_start(self, done: int) -> int:
        """Where the next round starts after columns ``< done`` ran: inside the same segment, or at
        the next segment's start."""
        segments = self.plan_segments
        i = self.segment
        if done < segments[i].end:
            return done
        return segments[i + 1].start if i + 1 < len(segments) else self.program.n_tokens

    def prefix_view(self, lo: int) -> np.ndarray:
        """Slots of columns ``[0, lo)`` as segment ``current(lo)`` reads them (0 where unread)."""
        assert self.active is not None
        segment = self.current(lo)
        view = np.zeros(lo, dtype=np.int64)
        view[segment.prefix_tokens] = self.resolve(segment.prefix_slots)
        view[segment.start : lo] = self.active.births[segment.start : lo]
        return view

    def round_positions(self, lo: int, hi: int) -> np.ndarray:
        segment = self.current(lo)
        return segment.positions[lo - segment.start : hi - segment.start]

    def round_copies(self, lo: int) -> CopyJob | None:
        """The segment's copy jobs, due before its first round."""
        segment = self.current(lo)
        return self._real(segment.copies) if lo == segment.start and segment.copies.size else None

    def bind(self, core: CacheCore, lo: int, slots: np.ndarray) -> None:
        assert self.active is not None
        core.bind_births(self.active, np.arange(lo, lo + slots.size, dtype=np.int64), slots)

    def terminal(self) -> tuple[np.ndarray, np.ndarray, CopyJob | None]:
        """Columns and slots generation reads, and the copies due before the first decode step."""
        assert self.active is not None
        view = self.active.plan.terminal
        copies = self._real(view.copies) if view.copies.size else None
        return view.tokens, self.resolve(view.slots), copies

    def visible_before(self, column: int) -> int:
        """Columns ``< column`` the query at ``column`` reads (a round's first query, or a decode step)."""
        n = self.program.n_tokens
        if column >= n:
            return self._n_kept + column - n
        keep, until = self.program.keep[:column], self.program.visible_until[:column]
        return int(np.count_nonzero(keep | (until > column)))

    @property
    def _n_kept(self) -> int:
        if self._kept is None or self._kept[0] is not self.program:
            self._kept = (self.program, int(np.count_nonzero(self.program.keep)))
        return self._kept[1]

    def decode_offset(self) -> int:
        """Position of column ``c >= n_tokens`` is ``c + decode_offset()``."""
        return self.program.next_position - self.program.n_tokens

    def visibility_row(self, width: int) -> np.ndarray:
        """``visible_until`` per column (kept and generated columns: :data:`VISIBLE_ALWAYS`)."""
        row = np.full(width, VISIBLE_ALWAYS, dtype=np.int64)
        n = self.program.n_tokens
        row[:n] = np.where(self.program.keep, VISIBLE_ALWAYS, self.program.visible_until)
        return row

    def resolve(self, slots: np.ndarray) -> np.ndarray:
        assert self.active is not None
        return resolve_births(slots, self.active.births)

    def _real(self, job: CopyJob) -> CopyJob:
        """``job`` on real slots (a birth re-rotated in place is named by its birth id at both ends)."""
        return CopyJob(job.tokens, self.resolve(job.src), self.resolve(job.dst), job.old_positions, job.new_positions)
