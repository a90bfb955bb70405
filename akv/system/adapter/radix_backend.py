"""``--radix-cache-backend akv``: every request, plain or context, is served from the cache core's
one radix tree over SGLang's KV pool, whose allocator stays the only free list.

- Plain requests match the longest prefix of tokens resident at their own positions; SGLang
  computes the rest as usual and the KV is published at the end (and at every chunk) like stock.
- Context requests (``Req.akv``, see :mod:`akv.system.adapter.context_request`) match and plan
  against the same tree, commit when SGLang locks them, and publish when they finish.

A lock handle (``req.last_node``) is the :class:`AkvRequest` itself or a :class:`PlainLock` over the
borrowed prefix slots; SGLang's ``inc_lock_ref`` / ``dec_lock_ref`` take and drop its references.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from akv.system.adapter import fa3_lists as akv_fa3
from akv.system.adapter import host_rows
from akv.system.adapter.batch_metadata import VisibilityTable
from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.device import to_device
from akv.system.adapter.live_guard import LiveGuard, enabled as protect_live_enabled
from akv.system.adapter.metrics import AkvMetrics
from akv.system.adapter.scheduling import ADMISSION_SLACK
from akv.system.adapter.window_lists import PositionTable, window_from_radius
from akv.system.cache import plain
from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.models.minimax_m2 import check_supported
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.runtime_context import get_server_args

_CHECK_HOST_ROWS = os.environ.get("AKV_CHECK_HOST_ROWS") == "1"


class AllocatorFreeList:
    """The pool's free list is SGLang's token allocator (slot tensors on the KV device)."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator

    @property
    def n_free(self) -> int:
        return int(self.allocator.available_size())

    def take(self, n: int) -> np.ndarray | None:
        slots = self.allocator.alloc(n)
        return None if slots is None else slots.cpu().numpy().astype(np.int64)

    def give(self, slots: np.ndarray) -> None:
        self.allocator.free(to_device(slots, self.allocator.device))


class RootNode:
    """The handle of an empty match: locking it holds nothing."""


class PlainLock:
    """A plain request's borrowed prefix: one request reference per slot while locked."""

    def __init__(self, slots: np.ndarray) -> None:
        self.slots = slots
        self.locks = 0


class AkvRadixCache(BasePrefixCache):
    """The cache core behind SGLang's prefix-cache interface (page size 1). ``window``: the model's
    sliding window (``config.sliding_window``; None without sliding-window layers); ``protect_live``:
    admission leaves live KV alone while requests are in flight (:mod:`akv.system.adapter.live_guard`)."""

    def __init__(self, params: CacheInitParams, window: int | None = None, protect_live: bool = False) -> None:
        if params.page_size != 1:
            raise ValueError(f"page_size: {params.page_size} is not supported by the AKV cache (needs 1)")
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = 1
        self.disable = False
        self.device = self.token_to_kv_pool_allocator.device
        allocator = self.token_to_kv_pool_allocator
        self.core = CacheCore(SlotPool(allocator.size, free_list=AllocatorFreeList(allocator)),
                              evict=lambda n: evict_from_tree_cache(self, n))
        self.root_node = RootNode()
        self.visibility = VisibilityTable(self.req_to_token_pool.req_to_token)
        server_args = get_server_args()
        self.metrics = AkvMetrics(bool(server_args.enable_metrics), server_args.served_model_name or "")
        self.window = window
        self.positions = None if window is None else PositionTable(self.req_to_token_pool.req_to_token)
        self.live_guard = LiveGuard() if protect_live else None

    # ---- matching and locking -------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        state = getattr(params.req, "akv", None)
        if state is not None:
            return self._match_context(params.req, state)
        key = params.key
        ids = np.frombuffer(key.raw_token_ids(), dtype=np.int64) if len(key) else np.zeros(0, np.int64)
        slots = plain.resident_prefix(self.core, ids, key.extra_key or "")
        host_rows.row_of(params.req).set(0, slots)
        if slots.size == 0:
            return self._result(slots, self.root_node)
        return self._result(slots, PlainLock(slots))

    def _match_context(self, req: Any, state: AkvRequest) -> MatchResult:
        state.window = self.window
        generated = len(req.output_ids)
        if state.active is None and generated > state.program.n_tokens - state.base.n_tokens:
            state.readmit(list(req.output_ids))
        if state.active is None:
            new_tokens = max(req.sampling_params.max_new_tokens - generated, 0)
            state.plan_draft(self.core, cold=bool(envs.SGLANG_RADIX_FORCE_MISS.get()),
                             room=self.core.pool.size - new_tokens - ADMISSION_SLACK)
        return self._result(np.zeros(state.first_start, dtype=np.int64), state)

    def _result(self, slots: np.ndarray, node: Any) -> MatchResult:
        indices = to_device(slots, self.device)
        return MatchResult(device_indices=indices, last_device_node=node, last_host_node=node, best_match_node=node)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if isinstance(node, AkvRequest):
            node.locks += 1
            if node.locks == 1:
                node.lock(self.core)
        elif isinstance(node, PlainLock):
            node.locks += 1
            if node.locks == 1:
                self.core.pool.incref(node.slots)
        return IncLockRefResult(delta=0)

    def dec_lock_ref(self, node: Any, params: Any = None) -> DecLockRefResult:
        if isinstance(node, AkvRequest) and node.locks > 0:
            node.locks -= 1
            if node.locks == 0:
                node.release(self.core, publish=False)
        elif isinstance(node, PlainLock) and node.locks > 0:
            node.locks -= 1
            if node.locks == 0:
                self.core.pool.decref(node.slots)
        return DecLockRefResult(delta=0)

    # ---- publication ----------------------------------------------------------------------------

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Plain requests publish what they computed so far; a context request between rounds gets
        the next round's prefix view, and gives back the births no later round reads when it recycles
        them (its terminal view is written before its first decode step,
        :func:`akv.system.adapter.batch_metadata.for_decode`, together with the copies it needs)."""
        state = getattr(req, "akv", None)
        if state is None:
            self._cache_unfinished_plain(req)
        elif chunked:
            start = state.next_start(req.extend_range.end)
            state.free_dead(self.core, start)
            req.prefix_indices = to_device(state.prefix_view(start), self.device)

    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int) -> None:
        """Publish the KV of the prompt and of every generated token fed back (all but the last), as
        the reference server does: the last token's KV, which only the overlap schedule computes, is
        freed, so what later requests reuse (and their usage) does not depend on the schedule."""
        state = getattr(req, "akv", None)
        if state is None:
            self._publish_plain(req, self._row(req, self._fed_back(req, kv_len_to_handle, 0)), is_insert)
            self.dec_lock_ref(req.last_node)
            return
        n = state.program.n_tokens
        generated = self._row(req, self._fed_back(req, kv_len_to_handle, n), start=n)
        done = n - state.base.n_tokens
        ids = np.asarray(list(req.output_ids)[done : done + generated.size], dtype=np.int64)
        self.core.pool.adopt(generated)
        self.metrics.released(req.rid, state)
        if is_insert and state.active is not None:
            state.release(self.core, ids, generated, publish=True)
        else:
            state.release(self.core, publish=False)
            self.core.pool.decref(generated)

    def _fed_back(self, req: Any, kv_len: int, start: int) -> int:
        """End of the columns ``< kv_len`` holding the prompt and the generated tokens fed back
        (at least ``start``); the columns after it, up to ``kv_len``, go back to the allocator."""
        end = min(kv_len, max(len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0), start))
        if kv_len > end:
            self.token_to_kv_pool_allocator.free(to_device(self._row(req, kv_len, start=end), self.device))
        return end

    def _cache_unfinished_plain(self, req: Any) -> None:
        row = self._row(req, len(req.get_fill_ids()))
        slots = self._publish_plain(req, row, True)
        lock = PlainLock(slots)
        self.inc_lock_ref(lock)
        self.dec_lock_ref(req.last_node)
        start = req.cache_protected_len
        fresh = to_device(slots[start:], self.device, torch.int32)
        self.req_to_token_pool.write((req.req_pool_idx, slice(start, slots.size)), fresh)
        host_rows.row_of(req).set(0, slots)
        req.prefix_indices = to_device(slots, self.device)
        req.cache_protected_len = slots.size
        req.last_node = lock

    def _publish_plain(self, req: Any, row: np.ndarray, is_insert: bool) -> np.ndarray:
        """Insert a plain request's tokens with their slots; its own slots go to the tree or back.
        Returns the slots resident for them now (empty when not inserted)."""
        ids = np.asarray((req.origin_input_ids + req.output_ids)[: row.size], dtype=np.int64) if is_insert else None
        return plain.publish(self.core, row, req.cache_protected_len, ids, req.extra_key or "",
                             generated=max(row.size - len(req.origin_input_ids), 0))

    def _row(self, req: Any, length: int, start: int = 0) -> np.ndarray:
        """The request's ``req_to_token`` columns ``[start, length)``, from the host copy (and, with
        ``AKV_CHECK_HOST_ROWS=1``, checked against the device row)."""
        row = host_rows.row_of(req).get(length)[start:]
        if _CHECK_HOST_ROWS:
            device = self.req_to_token_pool.req_to_token[req.req_pool_idx, start:length].cpu().numpy()
            if not np.array_equal(row, device):
                raise AssertionError(f"host row of {req.rid} differs from req_to_token: {row} != {device}")
        return row

    # ---- memory ---------------------------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``num_tokens`` slots in the tree's drop-aware order; with ``protect_live``, only what the
        pool lacks of them (SGLang asks for an allocation's whole size)."""
        n = params.num_tokens
        if self.live_guard is not None:
            n = max(n - self.core.pool.n_free, 0)
        evicted = self.core.tree.evict(n)
        self.metrics.evicted(evicted)
        return EvictResult(num_tokens_evicted=evicted)

    def evictable_size(self) -> int:
        """Slots only the tree holds; while ``protect_live`` protects, only its spare ones."""
        if self.live_guard is not None and self.live_guard.protecting:
            return self.core.tree.n_spare()
        return self.core.pool.n_evictable

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def protected_size(self) -> int:
        return self.core.pool.n_protected

    def full_protected_size(self) -> int:
        return self.core.pool.n_protected

    def total_size(self) -> int:
        return self.core.pool.n_held

    def reset(self) -> None:
        self.core.flush()

    def pretty_print(self) -> None:
        print(f"AKV tree {self.core.tree.stats()}, evictable {self.evictable_size()}, protected {self.protected_size()}")


def build(ctx: Any) -> AkvRadixCache:
    """Factory for SGLang's radix-cache registry. Refuses models whose layers keep a recurrent state
    instead of per-token KV (linear / lightning attention: the older MiniMax models), and SGLang's
    hybrid SWA memory: it frees the KV of sliding-layer keys once they leave the window, and a Drop
    brings older keys back into it; sliding-window models on FlashInfer (its window wrappers
    take no AKV lists); and on FA3 what :func:`akv.system.adapter.fa3_lists.check_model` refuses."""
    config = ctx.model_config.hf_config.to_dict()
    if str(config.get("model_type", "")).startswith("minimax"):
        check_supported(config)
    if ctx.is_hybrid_ssm:
        raise ValueError(f"model_type {config.get('model_type')!r}: layers with a recurrent state instead of "
                         "per-token KV cannot drop or reposition messages; the AKV cache needs softmax attention")
    if ctx.is_hybrid_swa:
        raise ValueError("is_hybrid_swa: the AKV cache needs every layer's KV kept for every token; start the "
                         "server with --disable-hybrid-swa-memory (python -m akv.system.launch_server adds it)")
    window = window_from_radius(ctx.tp_worker.sliding_window_size)
    server_args = get_server_args()
    backends = {server_args.attention_backend, server_args.decode_attention_backend, server_args.prefill_attention_backend}
    if window is not None and "flashinfer" in backends:
        raise ValueError("attention_backend 'flashinfer': AKV's sliding-window KV lists are built for the triton "
                         "backend only; serve this model with --attention-backend triton")
    if akv_fa3.BACKEND in backends:
        akv_fa3.check_model(ctx.model_config, window, server_args.kv_cache_dtype)
    return AkvRadixCache(ctx.params, window=window, protect_live=protect_live_enabled())
