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
    completion_tokens: int
    latency_s: float
    dropped_so_far: int
    repositions_so_far: int
    action: str

    @classmethod
    def from_usage(cls, step: int, messages: int, usage: Mapping[str, Any] | None, latency_s: float,
                   dropped_so_far: int, repositions_so_far: int, action: str) -> StepRecord:
        """Build from an OpenAI ``usage`` object; a missing usage is an error (the server must report it)."""
        if not isinstance(usage, Mapping):
            raise ValueError(f"step {step}: the server returned no usage object, got {usage!r}")
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            step=step,
            messages=messages,
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
            repos_tokens=int(details.get("repos_tokens") or 0),
            drop_skipped_tokens=int(details.get("drop_skipped_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=latency_s,
            dropped_so_far=dropped_so_far,
            repositions_so_far=repositions_so_far,
            action=action,
        )

    @property
    def new_tokens(self) -> int:
        """Prompt tokens not read from the cache: computed by this request, or dropped before any
        query read them. (``drop_skipped_tokens`` counts every dropped token, computed or reused,
        so it overlaps the other counts and is reported beside them, not added to them.)"""
        return self.prompt_tokens - self.cached_tokens - self.repos_tokens

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "new_tokens": self.new_tokens}


def step_line(record: StepRecord) -> str:
    """The line the demo prints after each step."""
    return (f"[step {record.step:2d}] served {record.prompt_tokens:6d} tok | cached {record.cached_tokens:6d} | "
            f"re-rotated {record.repos_tokens:5d} | skipped {record.drop_skipped_tokens:5d} | "
            f"new {record.new_tokens:6d} | {record.latency_s:6.2f} s | {record.action}")


# (title, field, width, format spec, meaning); the action column is left-aligned and unpadded.
_COLUMNS = (
    ("step", "step", 4, "d", "the call's number"),
    ("msgs", "messages", 5, "d", "messages sent"),
    ("sent", "prompt_tokens", 8, "d", "prompt tokens (usage.prompt_tokens) = cached + re-rot + new"),
    ("cached", "cached_tokens", 8, "d", "prompt tokens whose KV was reused at its own position (cached_tokens)"),
    ("re-rot", "repos_tokens", 8, "d", "prompt tokens whose KV was reused after re-rotating it to a new position "
                                       "(repos_tokens)"),
    ("new", "new_tokens", 9, "d", "prompt tokens not read from the cache: computed by this call, or dropped "
                                  "before any query of it read them (the server does not report the two apart)"),
    ("dropped", "drop_skipped_tokens", 8, "d", "prompt tokens hidden by a drop from every query after it "
                                               "(drop_skipped_tokens); they are also in cached, re-rot or new"),
    ("gen", "completion_tokens", 5, "d", "generated tokens"),
    ("latency_s", "latency_s", 10, ".2f", "seconds from sending the request to the end of the reply"),
    ("msgs-drop", "dropped_so_far", 10, "d", "messages dropped so far in the conversation"),
)
_SUMMED = ("prompt_tokens", "cached_tokens", "repos_tokens", "drop_skipped_tokens", "new_tokens",
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
