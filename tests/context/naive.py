"""A token-by-token simulator of DESIGN.md §1, written independently of the compiler, for tests."""

from __future__ import annotations

from dataclasses import dataclass, field

_AFTER_EVERY_ANCHOR = 1 << 62


@dataclass
class NaiveLayout:
    """Plain-Python results of the simulation, one list entry per token."""

    birth_position: list[int] = field(default_factory=list)
    birth_stage: list[int] = field(default_factory=list)
    visible_until: list[int] = field(default_factory=list)
    final_position: list[int] = field(default_factory=list)
    event_at: list[int] = field(default_factory=list)
    moves: list[dict[int, tuple[int, int]]] = field(default_factory=list)
    next_position: int = 0


def simulate(
    owners: list[int], drop_message: dict[int, list[int]], reposition: list[int], n_tokens_after: int = 0
) -> NaiveLayout:
    """Process tokens one by one; before each token, apply every event whose anchor message is done.

    ``n_tokens_after`` generated tokens (owner = reply) are appended at the end.
    """
    anchors = sorted(set(drop_message) | set(reposition))
    stream = owners + [_AFTER_EVERY_ANCHOR] * n_tokens_after
    n = len(stream)
    out = NaiveLayout(visible_until=[n] * n, final_position=[-1] * n)
    visible: list[int] = []
    pos: dict[int, int] = {}
    next_position = 0
    stage = 0
    pending = list(anchors)
    for t in range(n + 1):
        while pending and (t == n or stream[t] > pending[0]):
            anchor = pending.pop(0)
            if anchor in drop_message:
                gone = {s for s in visible if owners[s] in drop_message[anchor]}
                for s in gone:
                    out.visible_until[s] = t
                visible = [s for s in visible if s not in gone]
                out.event_at.append(t)
                out.moves.append({})
                stage += 1
            if anchor in reposition:
                moved = {}
                for rank, s in enumerate(visible):
                    if pos[s] != rank:
                        moved[s] = (pos[s], rank)
                    pos[s] = rank
                next_position = len(visible)
                out.event_at.append(t)
                out.moves.append(moved)
                stage += 1
        if t == n:
            break
        out.birth_position.append(next_position)
        out.birth_stage.append(stage)
        pos[t] = next_position
        next_position += 1
        visible.append(t)
    for s in visible:
        out.final_position[s] = pos[s]
    out.next_position = next_position
    return out
