"""Turn schedules: `after` the first turn that fires, then `every` n turns (None: only once)."""

from __future__ import annotations

from akv.agent import checks


def check_schedule(owner: str, after: object, every: object) -> None:
    checks.positive_int(owner, "after", after)
    checks.positive_int(owner, "every", every, optional=True)


def fires(turn: int, after: int, every: int | None) -> bool:
    """True when 1-based `turn` is `after`, or `after + k * every` for k >= 1."""
    if turn < after:
        return False
    if every is None:
        return turn == after
    return (turn - after) % every == 0
