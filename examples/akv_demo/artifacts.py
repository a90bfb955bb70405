"""Where a demo run writes its evidence: one folder per step plus run-level summaries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ArtifactError(RuntimeError):
    """The output directory cannot be used."""


def check_output(root: Path) -> None:
    """Raise ArtifactError unless ``root`` is absent or an empty directory (a run never overwrites another)."""
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ArtifactError(f"--output {str(root)!r} exists and is not empty; choose a new directory")


class RunArtifacts:
    """``root/run.json``, ``root/steps/NN/{payload_before,payload_after,history,reply,usage,action}.json``,
    ``root/steps/NN/trace/`` (the client's call trace), ``root/summary.{json,txt}``, ``root/plot.svg``."""

    def __init__(self, root: Path) -> None:
        check_output(root)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root

    def step_dir(self, step: int) -> Path:
        path = self.root / "steps" / f"{step:02d}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def trace_dir(self, step: int) -> Path:
        """A path that does not exist yet; the client creates it for the call's trace."""
        return self.step_dir(step) / "trace"

    def write_step(self, step: int, name: str, value: Any) -> Path:
        return write_json(self.step_dir(step) / f"{name}.json", value)

    def write(self, name: str, value: Any) -> Path:
        return write_json(self.root / name, value)


def write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")
    return path
