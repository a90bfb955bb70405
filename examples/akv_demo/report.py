"""Per-step measurements and the final summary table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """What one call cost: tokens sent and how the server served them, plus wall time."""

    step: int
    messages: int
    prompt_tokens: int
    cached_tokens: int
    repos_tokens: int
    drop_skipped_tokens: int
    computed_tokens: int
    completion_tokens: int
    latency_s: float
    dropped_so_far: int
    repositions_so_far: int
    action: str

    @classmethod
    def from_usage(cls, step: int, messages: int, usage: Mapping[str, Any] | None, latency_s: float,
                   dropped_so_far: int, repositions_so_far: int, action: str) -> StepRecord:
        """Build from an OpenAI ``usage`` object; a missing usage is an error (the server must report it).
        A request without ``computed_tokens`` (a plain request: nothing dropped) computed every prompt
        token it did not read from the cache."""
        if not isinstance(usage, Mapping):
            raise ValueError(f"step {step}: the server returned no usage object, got {usage!r}")
        details = usage.get("prompt_tokens_details") or {}
        prompt, cached = int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)
        repos = int(details.get("repos_tokens") or 0)
        computed = details.get("computed_tokens")
        return cls(
            step=step,
            messages=messages,
            prompt_tokens=prompt,
            cached_tokens=cached,
            repos_tokens=repos,
            drop_skipped_tokens=int(details.get("drop_skipped_tokens") or 0),
            computed_tokens=prompt - cached - repos if computed is None else int(computed),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=latency_s,
            dropped_so_far=dropped_so_far,
            repositions_so_far=repositions_so_far,
            action=action,
        )

    @property
    def unread_tokens(self) -> int:
        """Prompt tokens dropped before any query read them: neither computed nor read from the cache.
        With cached, re-rotated and computed they make up the prompt. (``drop_skipped_tokens`` counts
        every dropped token, computed or reused, so it overlaps the others.)"""
        return self.prompt_tokens - self.cached_tokens - self.repos_tokens - self.computed_tokens

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "unread_tokens": self.unread_tokens}


def step_line(record: StepRecord) -> str:
    """The line the demo prints after each step."""
    return (f"[step {record.step:2d}] served {record.prompt_tokens:6d} tok | cached {record.cached_tokens:6d} | "
            f"re-rotated {record.repos_tokens:5d} | computed {record.computed_tokens:6d} | "
            f"dropped unread {record.unread_tokens:5d} | hidden {record.drop_skipped_tokens:5d} | "
            f"{record.latency_s:6.2f} s | {record.action}")


# (title, field, width, format spec, meaning); the action column is left-aligned and unpadded.
_COLUMNS = (
    ("step", "step", 4, "d", "the call's number"),
    ("msgs", "messages", 5, "d", "messages sent"),
    ("sent", "prompt_tokens", 8, "d", "prompt tokens (usage.prompt_tokens) = cached + re-rot + computed + unread"),
    ("cached", "cached_tokens", 8, "d", "prompt tokens whose KV was reused at its own position (cached_tokens)"),
    ("re-rot", "repos_tokens", 8, "d", "prompt tokens whose KV was reused after re-rotating it to a new position "
                                       "(repos_tokens)"),
    ("computed", "computed_tokens", 9, "d", "prompt tokens whose KV this call computed (computed_tokens)"),
    ("unread", "unread_tokens", 8, "d", "prompt tokens dropped before any query read them: neither computed "
                                        "nor read from the cache"),
    ("hidden", "drop_skipped_tokens", 8, "d", "prompt tokens a drop hides from every query after it "
                                              "(drop_skipped_tokens), whether computed or reused before the drop; "
                                              "they overlap the four columns before"),
    ("gen", "completion_tokens", 5, "d", "generated tokens"),
    ("latency_s", "latency_s", 10, ".2f", "seconds from sending the request to the end of the reply"),
    ("msgs-drop", "dropped_so_far", 10, "d", "messages dropped so far in the conversation"),
)
_SUMMED = ("prompt_tokens", "cached_tokens", "repos_tokens", "computed_tokens", "unread_tokens", "drop_skipped_tokens",
           "completion_tokens", "latency_s")


def summary_table(records: Sequence[StepRecord]) -> str:
    """A fixed-width text table, one row per step plus a totals row."""
    header = "".join(title.rjust(width) for title, _, width, _, _ in _COLUMNS) + "  action"
    rule = "-" * len(header)
    rows = [header, rule]
    for record in records:
        values = record.as_dict()
        rows.append("".join(format(values[key], spec).rjust(width) for _, key, width, spec, _ in _COLUMNS)
                    + "  " + record.action)
    all_steps = totals(records)
    cells = []
    for _, key, width, spec, _ in _COLUMNS:
        text = "all" if key == "step" else format(all_steps[key], spec) if key in all_steps else ""
        cells.append(text.rjust(width))
    rows += [rule, "".join(cells).rstrip()]
    return "\n".join(rows)


def column_meanings() -> str:
    """What each column of :func:`summary_table` counts, one line per column."""
    width = max(len(title) for title, *_ in _COLUMNS)
    return "\n".join(f"{title.ljust(width)}  {meaning}" for title, *_, meaning in _COLUMNS) + \
        f"\n{'action'.ljust(width)}  what the harness did after the reply"


def totals(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Sums over all steps of the token counters and the latency."""
    return {key: sum(r.as_dict()[key] for r in records) for key in _SUMMED}
