"""``--akv-protect-live`` (``AKV_PROTECT_LIVE=1`` in the server's environment; off by default): while
requests are in flight, a request waits in SGLang's queue rather than evict KV that a conversation's
recorded path still reads.

- A scheduling pass *protects* once a request is in flight: SGLang's running batch holds an unfinished
  request, its chunked request or a context request between rounds is continuing (at the pass's
  start), or the pass has admitted a request already. While it protects, SGLang's admission
  (``PrefillAdder``: free slots plus ``evictable_size()``) sees as evictable only the tree's spare
  KV (:meth:`akv.system.cache.tree.RadixTree.n_spare`: versions of dropped tokens and stale positions
  that no request references); a request that needs more gets SGLang's NO_TOKEN and waits, and is
  tried again when a running request finishes.
- The first request of a pass that starts with nothing in flight is admitted as without the flag
  (everything evictable counts), so an idle server never refuses or stalls on a request it would
  serve without the flag.
- Eviction keeps its order (dropped, stale, LRU leaves) and frees only what an allocation lacks
  (SGLang asks the cache for the allocation's whole size): a pass admitted against free plus spare
  slots allocates no more than that, which the dropped and stale ranks cover, so its eviction stops
  before live KV.
- Decode steps and everything outside admission see the full evictable count, as without the flag.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

ENV = "AKV_PROTECT_LIVE"
FLAG = "--akv-protect-live"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the server was started with the flag; ValueError naming the variable and value for
    anything but unset, ``0`` or ``1``."""
    value = environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: {value!r} is not 0 or 1 (python -m akv.system.launch_server {FLAG} sets it)")
    return value == "1"


class LiveGuard:
    """The admission pass the scheduler is in, if any (set by :func:`watch`, cleared by :func:`unwatch`)."""

    def __init__(self) -> None:
        self._in_flight = False
        self._adder: Any = None

    @property
    def protecting(self) -> bool:
        """Whether admission must leave live KV alone now."""
        return self._adder is not None and (self._in_flight or bool(self._adder.can_run_list))

    def start(self, in_flight: bool, adder: Any) -> None:
        self._in_flight, self._adder = in_flight, adder

    def stop(self) -> None:
        self._in_flight, self._adder = False, None


def watch(scheduler: Any, adder: Any, running_batch: Any) -> None:
    """Scheduler hook: an admission pass starts with ``adder`` over ``running_batch``."""
    guard: LiveGuard | None = getattr(scheduler.tree_cache, "live_guard", None)
    if guard is None:
        return
    in_flight = (any(not req.finished() for req in running_batch.reqs) or scheduler.chunked_req is not None
                 or bool(scheduler.akv_rounds))
    guard.start(in_flight, adder)


def unwatch(scheduler: Any) -> None:
    """Scheduler hook: the admission pass (and its batch's allocation) is over."""
    guard: LiveGuard | None = getattr(scheduler.tree_cache, "live_guard", None)
    if guard is not None:
        guard.stop()
