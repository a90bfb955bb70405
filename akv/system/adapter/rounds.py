"""Context requests between prefill rounds outside SGLang's single chunked-request slot.

A context request prefills its contiguous segments in one round; it needs more rounds only where its
plan reuses resident columns between segments (recovery after eviction), where a sliding-window
model's extend would stop being exact, or where SGLang's chunk budget cuts it. SGLang keeps one
chunked request (``Scheduler.chunked_req``). A context request whose rounds would have to wait for
that slot continues here instead: between rounds its KV is cached and locked the
way the chunked request's is (``stash_chunked_request``), it stays out of the running batch, each
prefill batch re-adds it right after the chunked request (``PrefillAdder.add_chunked_req``), and
``inflight_middle_chunks`` makes the result processor skip it until its last round. Aborts and
retraction reach it here; nothing else in SGLang knows the list."""

from __future__ import annotations

from typing import Any

from akv.system.adapter.scheduling import reserve_rounds_left


class BetweenRounds:
    """The scheduler's context requests between rounds and the aborts pending for them."""

    def __init__(self) -> None:
        self.reqs: list[Any] = []
        self.aborts: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self.reqs)


def abort_pending(scheduler: Any) -> None:
    """Abort the listed requests an ``AbortReq`` named, at the top of a scheduling step (as
    ``process_pending_chunked_abort`` does for the chunked request): their KV is released without
    insertion. A round already launched is drained by the result processor (its
    ``inflight_middle_chunks``); one that left the list already is the running batch's (``to_finish``)."""
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.mem_cache.common import release_kv_cache

    rounds: BetweenRounds = scheduler.akv_rounds
    for req in rounds.aborts:
        if req not in rounds.reqs:
            continue
        rounds.reqs.remove(req)
        prepare_abort(req, "Aborted")
        req.to_finish = None
        release_kv_cache(req, scheduler.tree_cache, is_insert=False)
        scheduler.ipc_channels.send_to_tokenizer.send_output(AbortReq(rid=req.rid), req)
    rounds.aborts.clear()


def note_abort(scheduler: Any, recv_req: Any) -> None:
    """Mark the listed requests ``recv_req`` aborts (applied by :func:`abort_pending`)."""
    rounds: BetweenRounds = scheduler.akv_rounds
    rounds.aborts.extend(r for r in rounds.reqs if recv_req.abort_all or r.rid.startswith(recv_req.rid))


def stash(scheduler: Any) -> list[Any]:
    """Cache what each listed request's last round computed (when it ran one); the list, which the
    caller keeps out of the running batch."""
    for req in scheduler.akv_rounds.reqs:
        if req.extend_range.end > len(req.prefix_indices):
            scheduler.stash_chunked_request(req)
    return scheduler.akv_rounds.reqs


def add_to_batch(scheduler: Any, adder: Any) -> None:
    """Put the listed requests' next rounds into the batch being formed, while its chunk and total
    budgets have room (a request left out stays cached and locked for a later batch); a request whose
    last round this is leaves the list. Then what the context requests continuing after this batch
    (listed, or in SGLang's chunked-request slot) still need is reserved before any waiting request
    is admitted."""
    rounds: BetweenRounds = scheduler.akv_rounds
    kept = []
    for req in rounds.reqs:
        if min(adder.rem_chunk_tokens, int(adder.rem_total_tokens)) <= 0:
            kept.append(req)
            continue
        req.init_next_round_input()
        if adder.add_chunked_req(req) is not None:
            kept.append(req)
    rounds.reqs = kept
    reserve_rounds_left(adder, [scheduler.chunked_req, *kept])


def start_rounds(scheduler: Any, adder: Any) -> None:
    """Once the batch is formed: context requests admitted into it that continue join the list, and
    every listed request in the batch has one more middle round in flight."""
    rounds: BetweenRounds = scheduler.akv_rounds
    rounds.reqs.extend(adder.akv_new_rounds)
    in_batch = set(adder.can_run_list)
    for req in rounds.reqs:
        if req in in_batch:
            req.inflight_middle_chunks += 1


def retract(scheduler: Any, retract_reqs: list[Any]) -> None:
    """Add the listed unfinished requests to a full retraction (``pause_generation``) and empty the list."""
    rounds: BetweenRounds = scheduler.akv_rounds
    retract_reqs.extend(r for r in rounds.reqs if not r.finished() and r not in retract_reqs)
    rounds.reqs = []
    rounds.aborts = []


def mid_prefill(req: Any) -> bool:
    """A context request whose prefill has not reached its prompt's end: nothing to stream."""
    return (req.akv is not None and not req.output_ids and req.extend_range is not None
            and req.extend_range.end < len(req.full_untruncated_fill_ids))
