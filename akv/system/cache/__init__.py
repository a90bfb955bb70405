"""Cache core: record keys, radix tree with KV versions, occurrence and recovery planning,
drop-aware eviction and usage counters; engine-agnostic and CPU-testable with a simulated pool."""

from akv.system.cache.core import ActiveRequest, CacheCore, CacheFull, RequestStateError
from akv.system.cache.keys import RecordKey, plain_key, program_key
from akv.system.cache.plan import CopyJob, MatchResult, RequestPlan, Segment, TerminalView, Usage
from akv.system.cache.pool import PoolError, PoolExhausted, SlotPool
from akv.system.cache.tree import RadixTree

__all__ = [
    "ActiveRequest",
    "CacheCore",
    "CacheFull",
    "CopyJob",
    "MatchResult",
    "PoolError",
    "PoolExhausted",
    "RadixTree",
    "RecordKey",
    "RequestPlan",
    "RequestStateError",
    "Segment",
    "SlotPool",
    "TerminalView",
    "Usage",
    "plain_key",
    "program_key",
]
