"""Generated text so far: decode, detect stop strings, and hold back what may still change."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class TextTracker:
    """Decodes the generated ids each step (special tokens skipped) and applies ``stops``."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self.stopped = False

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def update(self, ids: Sequence[int]) -> str:
        """The text safe to show now; sets ``stopped`` when a stop string appeared (text cut before it)."""
        text = self.decode(ids)
        cut = self._first_stop(text)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        stable = text.rstrip(_INCOMPLETE)
        return stable[: len(stable) - self._partial_stop(stable)]

    def final(self, ids: Sequence[int]) -> str:
        """The finished reply text (cut at the first stop string, if any)."""
        text = self.decode(ids)
        cut = self._first_stop(text)
        return text[:cut] if cut >= 0 else text

    def _first_stop(self, text: str) -> int:
        """Where the earliest stop string starts in ``text``, -1 when none occurs."""
        return min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)

    def _partial_stop(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-size:]):
                    longest = size
                    break
        return longest
