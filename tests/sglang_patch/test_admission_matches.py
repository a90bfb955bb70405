"""How often a waiting context request is matched and planned (``AkvRequest.plan_draft``), counted
against what must be planned: once, unless the tree changed on its path. SGLang's admission locks a
waiting request to check its budget and unlocks it when it must wait, step after step."""

from __future__ import annotations

import numpy as np

from akv.system.adapter.context_request import AkvRequest
from akv.system.cache import plain
from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules


def _turns() -> tuple[np.ndarray, object]:
    """A published plain turn's ids and its next turn's program (one result dropped, repositioned)."""
    lengths = [6, 4, 9, 4, 9, 4, 9, 3]
    ids = (np.arange(sum(lengths), dtype=np.int64) * 7 + 1) % 97
    owners = np.repeat(np.arange(len(lengths)), lengths)
    anchor = len(lengths) - 2
    program = compile_program(ids, owners, parse_rules({str(anchor): [2]}, [anchor], anchor + 1), anchor + 1)
    return ids[: sum(lengths[:-3])], program


def _counting(core: CacheCore) -> list[int]:
    calls = [0]
    match = core.match

    def counted(*args, **kwargs):
        calls[0] += 1
        return match(*args, **kwargs)

    core.match = counted
    return calls


def test_a_lock_dropped_before_commit_keeps_the_draft() -> None:
    """Three scheduling steps in which the request is locked for the budget check and unlocked again
    (nothing on its path changes), then admitted: one plan."""
    core = CacheCore(SlotPool(400))
    turn, program = _turns()
    plain.publish(core, core.pool._free_list.take(turn.size), 0, turn, "")
    calls = _counting(core)
    state = AkvRequest(program)
    for _ in range(3):
        state.plan_draft(core, room=300)
        state.locks += 1
        state.lock(core)
        state.locks -= 1
        state.release(core, publish=False)  # what the radix cache does when the lock count reaches 0
        assert core.pool.n_protected == 0
    state.plan_draft(core, room=300)
    state.lock(core)
    state.commit(core)
    assert calls[0] == 1
    state.release(core, publish=False)
    assert core.pool.n_protected == 0


def test_a_change_on_the_path_plans_again_and_one_elsewhere_does_not() -> None:
    core = CacheCore(SlotPool(400))
    turn, program = _turns()
    plain.publish(core, core.pool._free_list.take(turn.size), 0, turn, "")
    calls = _counting(core)
    state = AkvRequest(program)
    state.plan_draft(core, room=300)
    other = np.arange(20, dtype=np.int64) + 100  # another conversation: its own first token
    plain.publish(core, core.pool._free_list.take(other.size), 0, other, "")
    state.plan_draft(core, room=300)
    assert calls[0] == 1
    longer = np.concatenate([turn, program.token_ids[turn.size : turn.size + 2]])  # extends the turn's path
    row = np.concatenate([plain.resident_prefix(core, turn, ""), core.pool._free_list.take(2)])
    plain.publish(core, row, turn.size, longer, "")
    state.plan_draft(core, room=300)
    assert calls[0] == 2
