"""``/server_info``'s ``akv`` block (akv.system.adapter.load_report) on a scheduler's state: the pool
split into live, cached and free slots, and the unfinished requests (context ones among them) counted
once each, wherever the scheduler keeps them. The served numbers are checked in tests/sglang_cpu/test_router.py."""

from __future__ import annotations

from types import SimpleNamespace

from akv.system.adapter.load_report import worker_load


def req(context: bool, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(akv=object() if context else None, finished=lambda: finished)


def scheduler(*, running, rounds, chunked, waiting, free=600, evictable=250) -> SimpleNamespace:
    return SimpleNamespace(max_total_num_tokens=1000,
                           token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: free),
                           tree_cache=SimpleNamespace(evictable_size=lambda: evictable),
                           running_batch=SimpleNamespace(reqs=running), akv_rounds=SimpleNamespace(reqs=rounds),
                           chunked_req=chunked, waiting_queue=waiting)


def test_the_pool_split_and_the_request_counts() -> None:
    plain, ctx, between, chunked = req(False), req(True), req(True), req(True)
    waiting = [req(True), req(False), req(False), req(True, finished=True)]
    done = req(True, finished=True)  # finished in the last step, filtered out of the batch at the next
    report = worker_load(scheduler(running=[plain, ctx, chunked, done], rounds=[between], chunked=chunked,
                                   waiting=waiting))
    assert report == {"kv_capacity_tokens": 1000, "kv_live_tokens": 150, "kv_cached_tokens": 250, "kv_free_tokens": 600,
                      "requests_running": 4, "requests_waiting": 3,
                      "context_requests_running": 3, "context_requests_waiting": 1}


def test_an_idle_scheduler() -> None:
    report = worker_load(scheduler(running=[], rounds=[], chunked=None, waiting=[], free=1000, evictable=0))
    assert report["kv_live_tokens"] == 0 and report["kv_free_tokens"] == 1000
    assert report["requests_running"] == report["context_requests_running"] == 0
