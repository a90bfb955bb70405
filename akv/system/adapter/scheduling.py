"""Scheduler hooks: the program reaches ``Req``; a context request's prefill round runs every segment
of a contiguous run of them in one forward (SGLang's chunk budget still cuts it), and stops only where
the next segment starts after a gap of reused columns or, on a sliding-window model, at a segment's
end, or before a segment that re-rotates KV an earlier one of the round reads, or (births recycled)
where the round would hold more than the request's fewest births; a request with more rounds
continues in or beside SGLang's chunked-request slot; admission reserves copy slots and the rounds
left of requests between rounds, and counts recycled births at their peak, not the text."""

from __future__ import annotations

from typing import Any

import numpy as np

from akv.system.adapter import lengths, pd_decode
from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.serving import REQUIRED_RADIX_CACHE_BACKEND
from akv.system.cache.lifetimes import cold_single_peak

ADMISSION_SLACK = 2
"""Slots SGLang's admission needs on an idle server beyond a request's own (``PrefillAdder.add_one_req``:
births + new tokens + one page must stay strictly below the pool)."""


def attach(req: Any, recv_req: Any, server_args: Any, pool_size: int, context_len: int | None = None) -> str | None:
    """Give ``req`` its AKV state from the tokenized request; an error message (HTTP 400) when the
    program is malformed, the server cannot execute it, its live length does not fit ``context_len``
    (:func:`akv.system.adapter.lengths.request_problem`) or its KV could never fit the pool (one
    that does not fit now waits in SGLang's queue, its copy slots counted by :func:`extra_budget`).
    Like SGLang's ``init_req_max_new_tokens`` for a plain prompt, ``max_new_tokens`` is clipped so that
    admission's count on an idle server fits the pool, and so that the text with its new tokens fits a
    ``req_to_token`` row: a request that never fits would wait forever, and every request queued
    behind it. On an idle server, with nothing resident that it can reuse, the least a request can
    hold is its births (every token something reads, computed once) re-rotated in place, each given
    back once no later round reads it: per round, that round's births and the earlier ones still
    read (:func:`akv.system.cache.lifetimes.cold_single_peak`), the plan the server falls
    back to when its births and copies do not fit beside its new tokens
    (:meth:`akv.system.adapter.context_request.AkvRequest.plan_draft`). On a PD decode server it gets
    its decode-side state instead (:func:`akv.system.adapter.pd_decode.attach`)."""
    data = getattr(recv_req, "context_program", None)
    if data is None:
        return None
    if server_args.disaggregation_mode == "decode":
        return pd_decode.attach(req, data, server_args, context_len)
    if server_args.radix_cache_backend != REQUIRED_RADIX_CACHE_BACKEND:
        return (f"server configuration: radix_cache_backend {server_args.radix_cache_backend!r} cannot execute "
                "drop_message/reposition (start with python -m akv.system.launch_server)")
    if not server_args.chunked_prefill_size or server_args.chunked_prefill_size <= 0:
        return "server configuration: drop_message/reposition need chunked prefill (--chunked-prefill-size > 0)"
    program = lengths.request_program(req, data, context_len)
    if isinstance(program, str):
        return program
    wanted = req.sampling_params.max_new_tokens
    if context_len is not None:
        columns = lengths.text_limit(context_len) - program.n_tokens
        wanted = columns if wanted is None else min(wanted, columns)
    fits = wanted is not None and program.n_tokens + wanted + ADMISSION_SLACK <= pool_size  # births at most
    needed = program.n_tokens if fits else cold_single_peak(program)
    room = pool_size - needed - ADMISSION_SLACK
    if room < 0:
        return (f"messages: the prompt needs {needed} KV slots at once (the tokens later ones read while a "
                f"round is computed, re-rotated in place, and {ADMISSION_SLACK} for admission), more than the "
                f"{pool_size} this server holds")
    req.sampling_params.max_new_tokens = room if wanted is None else min(wanted, room)
    req.akv = AkvRequest(program, req.extra_key or "")
    return None


def cap_extend(req: Any) -> bool:
    """Stop a context request's round where its run of contiguous segments ends, or before a segment
    whose copies reuse a slot that the run reads (on a sliding-window model: at its segment's end, or
    earlier where the window's extend would stop being exact); True when columns remain after it."""
    state: AkvRequest | None = req.akv
    if state is None:
        return False
    lo, hi = req.extend_range.start, req.extend_range.end
    req.set_extend_range(lo, _round_end(state, lo, hi))
    return req.extend_range.end < len(req.full_untruncated_fill_ids)


def _round_end(state: AkvRequest, lo: int, hi: int) -> int:
    segments = state.plan_segments if state.active is not None else state.plan_draft_segments()
    i = int(np.searchsorted(np.fromiter((s.end for s in segments), np.int64, len(segments)), lo, side="right"))
    if state.window is not None:
        return state.round_end(segments[i], lo, hi)
    end, reads = segments[i].end, [segments[i].prefix_slots, segments[i].slots]
    if state.lifetimes is not None:  # births recycled: the round holds at most the fewest births
        hi = min(hi, state.lifetimes.round_end(lo, end, state.lifetimes.single_peak()))
    while end < hi and i + 1 < len(segments) and segments[i + 1].start == end and not _recycles(segments[i + 1], reads):
        i += 1
        end = segments[i].end
        reads += [segments[i].prefix_slots, segments[i].slots]
    return min(hi, end)


def _recycles(segment: Any, reads: list[np.ndarray]) -> bool:
    """Whether ``segment``'s copies write a slot that earlier segments of the round read or write (the
    plan recycles a copy slot once its last reader ran, and may re-rotate a birth in place after its
    last reader; in one forward every copy runs before attention)."""
    return segment.copies.size > 0 and bool(np.isin(segment.copies.dst, np.concatenate(reads)).any())


def must_wait(adder: Any, req: Any, has_chunked_req: bool) -> bool:
    """SGLang runs one chunked request at a time. While one holds that slot (a request continuing its
    rounds, or one added to this batch), another joins the batch only if its first round fits the
    chunk budget left: a context request's first round ends at its first segment's end (later rounds
    continue outside the slot, :mod:`akv.system.adapter.rounds`), a plain prompt's is the whole
    prompt (SGLang cannot chunk a second one). Plain traffic around a plain chunked request takes
    SGLang's own path."""
    if not has_chunked_req and adder.new_chunked_req is None:
        return False
    state: AkvRequest | None = req.akv
    if state is None and not any(r.akv is not None for r in adder.can_run_list):
        return False
    budget = adder.rem_chunk_tokens
    if budget is None:
        return True
    lo, hi = len(req.prefix_indices), len(req.full_untruncated_fill_ids)
    end = hi if state is None or state.draft is None else _round_end(state, lo, hi)
    return end - lo > budget


def hold_rounds(adder: Any, req: Any, has_chunked_req: bool) -> None:
    """Keep ``req``, whose prefill continues after this round, for its next rounds: in SGLang's
    chunked-request slot when that is free (always for a plain prompt: SGLang's path), else, for a
    context request, in the scheduler's list of requests between rounds."""
    if req.akv is None or (not has_chunked_req and adder.new_chunked_req is None):
        adder.new_chunked_req = req
    else:
        adder.akv_new_rounds.append(req)


def extra_budget(req: Any) -> int:
    """What admission adds to SGLang's count of a waiting request's slots (its columns after the
    matched prefix, new tokens and a page): for a context request its copy slots, less the columns it
    borrows instead of computing (those are counted where its lock holds them) and the births it gives
    back before later ones are born; 0 for plain."""
    state: AkvRequest | None = req.akv
    if state is None or state.draft is None:
        return 0
    columns = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
    return state.birth_peak() + state.extra_budget() - columns


def charge_copies(adder: Any, req: Any) -> None:
    """Once ``req`` is admitted into the batch, take its copy slots from the adder's remaining
    budgets (total and this batch's), so the next request's check sees them as used."""
    state: AkvRequest | None = req.akv
    extra = 0 if state is None else state.extra_budget()
    adder.rem_total_token_offset += extra
    adder.cur_rem_token_offset += extra


def reserve_rounds_left(adder: Any, reqs: list[Any]) -> None:
    """Take from the adder's total budget what the context requests among ``reqs``, continuing their
    prefill after this batch, still need: the columns after their latest round (with births recycled,
    at most what their fewest births leave beside those still held then) and their new tokens.
    SGLang charges a chunked request one chunk per batch, safe while its chunks fill the chunk budget;
    a context request's rounds also end before gaps of reused columns, so others join the batch
    between them and, without this, take the KV its later rounds need (``alloc_for_extend`` then runs
    out of memory)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    for req in reqs:
        if req is None or req.akv is None or req.finished():
            continue
        columns = len(req.full_untruncated_fill_ids) - req.extend_range.end
        lifetimes = req.akv.lifetimes
        if lifetimes is not None:
            columns = min(columns, max(lifetimes.single_peak() - lifetimes.held_at(req.extend_range.end), 0))
        new_tokens = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        adder.rem_total_token_offset += columns + new_tokens
