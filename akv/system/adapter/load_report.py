"""What a worker holds, for routers and operators: ``/server_info``'s ``internal_states[i]["akv"]``.

The KV pool is split three ways: *live* slots are held by requests (running, between rounds, or
locked by a request in flight), *cached* slots are resident KV that the AKV tree can evict (what a
later turn of a conversation reuses), *free* slots are empty. SGLang's own ``/v1/loads`` reports
the live count as ``num_used_tokens`` (smg's load policies read it); this adds the cached part and
the context requests (those with drop_message/reposition) running and waiting, beside all
requests."""

from __future__ import annotations

from typing import Any


def worker_load(scheduler: Any) -> dict[str, int]:
    """The scheduler's KV split and request counts (ints, JSON-ready). A finished request still in
    the running batch (its KV already handed to the tree) no longer counts."""
    capacity = int(scheduler.max_total_num_tokens)
    free = int(scheduler.token_to_kv_pool_allocator.available_size())
    cached = int(scheduler.tree_cache.evictable_size())
    running = {id(req): req for req in scheduler.running_batch.reqs if not req.finished()}
    for req in (*scheduler.akv_rounds.reqs, scheduler.chunked_req):
        if req is not None and not req.finished():
            running[id(req)] = req
    waiting = [req for req in scheduler.waiting_queue if not req.finished()]
    return {
        "kv_capacity_tokens": capacity,
        "kv_live_tokens": capacity - free - cached,
        "kv_cached_tokens": cached,
        "kv_free_tokens": free,
        "requests_running": len(running),
        "requests_waiting": len(waiting),
        "context_requests_running": sum(_is_context(req) for req in running.values()),
        "context_requests_waiting": sum(_is_context(req) for req in waiting),
    }


def _is_context(req: Any) -> bool:
    return getattr(req, "akv", None) is not None
