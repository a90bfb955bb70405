"""Cache core: record keys, radix tree with KV versions, occurrence and recovery planning,
drop-aware eviction and usage counters; engine-agnostic and CPU-testable with a simulated pool.

An engine drives :class:`CacheCore`: ``admit(program, namespace)`` returns an :class:`ActiveRequest`
whose :class:`RequestPlan` lists the segments to run (copy jobs first, then the queries with their
exact visible slots) and the terminal view generation reads; ``allocate(n)`` gives decode slots;
``finish(request, generated_ids, generated_slots)`` publishes and releases; ``abort`` releases.
"""

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
