"""Where every token sits at each stage of a program (DESIGN.md §1: Repos moves, Drop does not)."""

from __future__ import annotations

import numpy as np

from akv.system.context.program import ContextProgram


class StagePositions:
    """Positions at a stage, for every token born by then (later tokens show their birth position).

    Built by replaying the program's transitions; stages are cheapest asked in increasing order.
    """

    def __init__(self, program: ContextProgram) -> None:
        self._moves = {t.event: t for t in program.transitions}
        self._birth = program.birth_position
        self._n_stages = program.n_stages
        self._stage = 0
        self._current = program.birth_position.copy()
        self._snapshots: dict[int, np.ndarray] = {}

    def at(self, stage: int) -> np.ndarray:
        if not 0 <= stage < self._n_stages:
            raise ValueError(f"stage: {stage} is outside 0..{self._n_stages - 1}")
        if stage in self._snapshots:
            return self._snapshots[stage]
        if stage < self._stage:
            self._stage, self._current = 0, self._birth.copy()
        while self._stage < stage:
            move = self._moves.get(self._stage)
            if move is not None:
                self._current[move.tokens] = move.new_positions
            self._stage += 1
        snapshot = self._current.copy()
        snapshot.flags.writeable = False
        self._snapshots[stage] = snapshot
        return snapshot
