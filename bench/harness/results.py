"""One result format: a JSON object that starts with where it came from (the exact command, the
commit, the date and the machine), written to a file that did not exist before the run (rewritten
as the run goes on) and, for the scripts that ask, copied into ``$OUT`` (a device call brings back
``$OUT``, at most 8 files: tools/gpu/run.sh packs the rest of ``$AKV_BENCH_OUT``)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str | None:
    """The checkout's commit, with ``+changes`` when the working tree differs from it; None where
    there is no git history (a device machine gets the files, not the repository)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def machine() -> dict[str, Any]:
    """The processor, Python, CPU count, load average and the GPUs (names from ``nvidia-smi -L``)."""
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            gpus = [line.split(" (UUID")[0] for line in listed.splitlines() if line.startswith("GPU")]
        except (OSError, subprocess.SubprocessError):
            pass
    return {"processor": platform.processor() or platform.machine(), "system": platform.system(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "gpus": gpus}


def gpu_label(machine_info: dict[str, Any]) -> str:
    """The first GPU's name as ``nvidia-smi -L`` gives it, without its index and vendor ("H100 80GB
    HBM3"), or "no GPU"."""
    gpus = machine_info.get("gpus") or []
    if not gpus:
        return "no GPU"
    return gpus[0].split(": ", 1)[-1].removeprefix("NVIDIA ")


def header(entry: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The fields every result starts with; ``entry`` is the script's path in the checkout and
    ``argv`` its arguments (default: this process's)."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": shlex.join(["python", entry, *args]), "commit": commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}


def write(report: dict[str, Any], path: Path, indent: int = 1, copy_to_out: bool = False) -> None:
    """Write ``report`` to ``path`` (its folder made) and, with ``copy_to_out`` where ``$OUT`` is set
    and another folder, a copy of the file there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=indent) + "\n"
    path.write_text(text, encoding="utf-8")
    copy_to = os.environ.get("OUT") if copy_to_out else None
    if copy_to and Path(copy_to).resolve() != path.parent.resolve():
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        (Path(copy_to) / path.name).write_text(text, encoding="utf-8")


def show(report: dict[str, Any], path: Path | None, indent: int = 2) -> None:
    """Print ``report`` as JSON, and :func:`write` it to ``path`` where one is given."""
    print(json.dumps(report, indent=indent), flush=True)
    if path is not None:
        write(report, path, indent)


def refuse_existing(parser: Any, path: Path) -> None:
    """A parser error where ``path`` exists: results are never replaced."""
    if path.exists():
        parser.error(f"{path} exists; results are never replaced: give a new --out")


def markdown_table(head: Any, rows: Any) -> str:
    """A markdown table: the ``head`` cells, then one line per row of cells (strings)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"
