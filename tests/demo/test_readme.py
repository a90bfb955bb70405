"""README.md runs as printed, in order: the quick start's commands, then every Python snippet, each on
its own (a snippet needs nothing from the one before it).

The install line is skipped (this environment has it). Two substitutions only: a tiny random model stands in for the converted SmolLM2 (written where the
conversion command would write it, under the same name), and a free port replaces 30000."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from akv.system.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
sys.path.insert(0, str(ROOT / "examples"))

from akv_demo.report import StepRecord, step_line  # noqa: E402

PRINTED_PORT = "30000"


def section(title_start: str) -> str:
    start = README.index(f"\n## {title_start}")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of `text` whose info string is `language`, in order."""
    blocks, body, info = [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if body is None:
                body, info = [], line[3:].strip()
            else:
                if info == language:
                    blocks.append("".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def quick_start_commands() -> list[str]:
    """The quick start's shell lines after the install, then its inline one-process command, comments
    removed."""
    text = section("Quick start")
    lines = [line.split("  #")[0].strip() for line in fenced(text, "bash")[0].splitlines()]
    inline = re.findall(r"`(python examples/demo\.py [^`]+)`", text)
    return [line for line in lines if line and not line.startswith("python -m pip install")] + inline


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh checkout's shape: `examples/` and nothing else."""
    path = tmp_path_factory.mktemp("newcomer")
    (path / "examples").symlink_to(ROOT / "examples")
    return path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def argv(command: str, port: str) -> list[str]:
    words = shlex.split(command.replace(PRINTED_PORT, port))
    assert words[0] == "python"
    return [sys.executable, *words[1:]]


@pytest.fixture(scope="module")
def quick_start(workdir: Path) -> Iterator[tuple[str, list[subprocess.CompletedProcess]]]:
    """Run the quick start in order; yields the background server's URL and the foreground runs."""
    commands = quick_start_commands()
    convert, serve, *demos = commands
    assert convert == "python -m akv.system.models smollm2 models/smollm2"
    make_tiny_model(workdir / "models" / "smollm2", seed=4)
    assert serve.endswith(" &")
    port = free_port()
    server = subprocess.Popen(argv(serve[:-2], port), cwd=workdir, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        runs = [subprocess.run(argv(command, port), cwd=workdir, env=env(), capture_output=True, text=True,
                               timeout=600) for command in demos]
        yield f"http://127.0.0.1:{port}", runs
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_quick_start_commands_run_as_printed_in_order(quick_start, workdir: Path) -> None:
    _, runs = quick_start
    assert len(runs) == 2, "the two-process demo, then the one-process one"
    for run in runs:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "chain completed: True" in run.stdout
    outputs = [shlex.split(c)[shlex.split(c).index("--output") + 1] for c in quick_start_commands()[2:]]
    assert len(set(outputs)) == len(outputs)
    for output in outputs:
        assert (workdir / output / "summary.json").is_file()


def test_the_sample_step_line_has_the_format_the_demo_prints() -> None:
    (line,) = [m for m in fenced(section("Quick start"), "") if m.startswith("[step")]
    line = line.strip()
    numbers = re.match(r"\[step +(\d+)\] served +(\d+) tok \| cached +(\d+) \| re-rotated +(\d+) \| "
                       r"computed +(\d+) \| dropped unread +(\d+) \| hidden +(\d+) \| +([\d.]+) s \| (.+)$", line)
    assert numbers, line
    step, served, cached, repos, computed, unread, hidden, latency, action = numbers.groups()
    record = StepRecord(int(step), 0, int(served), int(cached), int(repos), int(hidden), int(computed), 0,
                        float(latency), 0, 0, action)
    assert record.unread_tokens == int(unread)
    assert step_line(record) == line


def expected_output(snippet: str) -> list[str]:
    """What the snippet's `print(...)  # output` comments say it prints, in order."""
    return [line.split("# ", 1)[1].strip() for line in snippet.splitlines()
            if line.startswith("print(") and "# " in line]


@pytest.mark.slow
def test_python_snippets_run_as_printed_in_order(quick_start, workdir: Path) -> None:
    url, _ = quick_start
    snippets = fenced(README, "python")
    assert len(snippets) >= 2
    for k, snippet in enumerate(snippets):
        namespace: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(snippet.replace(PRINTED_PORT, url.rsplit(":", 1)[1]), f"README python snippet {k + 1}",
                         "exec"), namespace)
        assert out.getvalue().splitlines() == expected_output(snippet), f"snippet {k + 1}"
    from akv.agent.tokens import ChatTemplateTokenCounter

    reply, payload = namespace["reply"], namespace["payload"]
    counted = ChatTemplateTokenCounter.from_pretrained(workdir / "models" / "smollm2").layout(payload["messages"])
    assert reply.model == "smollm2" and reply.usage.prompt_tokens == counted.prompt_tokens
