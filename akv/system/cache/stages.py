"""Where every token sits at each stage of a program (DESIGN.md §1: Repos moves, Drop does not)."""

from __future__ import annotations

import numpy as np

from akv.system.context.program import ContextProgram


class StagePositions:
    """Positions at a stage of the tokens asked for (a token born later shows its birth position).

    A token's position at a stage is the new position the last Repos before that stage gave it, or
    its birth position if none moved it: found by walking the transitions back from the stage, each
    searched only for the asked tokens in the range it moved, so the work follows the tokens asked
    and the transitions, not the text.
    """

    def __init__(self, program: ContextProgram) -> None:
        # from each transition's runs: its tokens are worked out only if a walk reaches it
        self._moves = [t for t in program.transitions if t.moves.starts.size]
        self._events = np.asarray([t.event for t in self._moves], dtype=np.int64)
        firsts = np.asarray([int(t.moves.starts[0]) for t in self._moves], dtype=np.int64)
        lasts = np.asarray([int(t.moves.starts[-1] + t.moves.lengths[-1]) - 1 for t in self._moves], dtype=np.int64)
        self._firsts, self._lasts = firsts, lasts
        # the least and the greatest token the first k transitions moved (none outside moved before them)
        self._lowest = np.minimum.accumulate(firsts) if firsts.size else firsts
        self._highest = np.maximum.accumulate(lasts) if lasts.size else lasts
        self._birth = program.birth_position
        self._n_stages = program.n_stages

    def at(self, stage: int, tokens: np.ndarray) -> np.ndarray:
        """Positions of ``tokens`` (ascending) at ``stage``."""
        if not 0 <= stage < self._n_stages:
            raise ValueError(f"stage: {stage} is outside 0..{self._n_stages - 1}")
        tokens = np.asarray(tokens, dtype=np.int64)
        out = self._birth[tokens].copy()
        k = int(np.searchsorted(self._events, stage, side="left"))  # the transitions before ``stage``
        if k == 0 or tokens.size == 0:
            return out
        pending = np.arange(int(np.searchsorted(tokens, self._lowest[k - 1])), tokens.size)
        open_tokens = tokens[pending]
        for j in range(k - 1, -1, -1):
            top = int(np.searchsorted(open_tokens, self._highest[j], side="right"))
            pending, open_tokens = pending[:top], open_tokens[:top]
            if top == 0 or open_tokens[-1] < self._lowest[j]:
                break  # the tokens left were never moved before this point
            move = self._moves[j]
            lo, hi = np.searchsorted(open_tokens, (self._firsts[j], self._lasts[j] + 1)).tolist()
            if hi == lo:
                continue
            found = np.minimum(np.searchsorted(move.tokens, open_tokens[lo:hi]), move.tokens.size - 1)
            hit = move.tokens[found] == open_tokens[lo:hi]
            if not hit.any():
                continue
            out[pending[lo:hi][hit]] = move.new_positions[found[hit]]
            left = np.ones(pending.size, dtype=bool)
            left[lo:hi] = ~hit
            pending, open_tokens = pending[left], open_tokens[left]
        return out
