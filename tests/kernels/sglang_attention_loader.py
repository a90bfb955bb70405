"""Load SGLang 0.5.16's Triton decode/extend attention kernels for tests.

With SGLang importable (the H200 site) the real modules are used. Otherwise the four kernel source
files are loaded straight from an unpacked package directory (``AKV_SGLANG_DIR``), a wheel
(``AKV_SGLANG_WHEEL``), or else the pinned wheel the build step fetches and caches, with the two
``sglang.srt.utils`` platform probes they import stubbed."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from akv.system._build import BuildError, default_cache_dir, fetch_stock_wheel, python_tag

_PACKAGE = "sglang.kernels.ops.attention"
_FILES = ("score_mod", "prefill_attention", "decode_attention", "extend_attention")


@dataclass(frozen=True)
class SglangAttention:
    decode_attention_fwd: Callable[..., None]
    extend_attention_fwd: Callable[..., None]
    source: str


def _installed() -> SglangAttention | None:
    try:
        decode = importlib.import_module(f"{_PACKAGE}.decode_attention")
        extend = importlib.import_module(f"{_PACKAGE}.extend_attention")
    except ImportError:
        return None
    return SglangAttention(decode.decode_attention_fwd, extend.extend_attention_fwd, "installed sglang")


def _source_dir() -> Path | None:
    if os.environ.get("AKV_SGLANG_DIR"):
        return Path(os.environ["AKV_SGLANG_DIR"]) / "kernels" / "ops" / "attention"
    wheel = os.environ.get("AKV_SGLANG_WHEEL")
    if not wheel:
        try:
            wheel = str(fetch_stock_wheel(python_tag(), default_cache_dir()))
        except BuildError:
            return None
    target = Path(tempfile.mkdtemp(prefix="akv-sglang-"))
    with zipfile.ZipFile(wheel) as archive:
        for name in _FILES:
            archive.extract(f"sglang/kernels/ops/attention/{name}.py", target)
    return target / "sglang" / "kernels" / "ops" / "attention"


def _from_files(directory: Path) -> SglangAttention:
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False
    utils.is_cuda = torch.cuda.is_available
    utils.is_gfx95_supported = lambda: False
    packages = {}
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", _PACKAGE, "sglang.srt"):
        packages[name] = types.ModuleType(name)
        packages[name].__path__ = []
    packages["sglang.srt.utils"] = utils
    saved = {name: sys.modules.get(name) for name in packages}
    sys.modules.update(packages)
    try:
        loaded = {}
        for name in _FILES:
            spec = importlib.util.spec_from_file_location(f"{_PACKAGE}.{name}", directory / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
    finally:
        for name in _FILES:
            sys.modules.pop(f"{_PACKAGE}.{name}", None)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return SglangAttention(
        loaded["decode_attention"].decode_attention_fwd,
        loaded["extend_attention"].extend_attention_fwd,
        f"files from {directory}",
    )


def load() -> SglangAttention | None:
    """SGLang's attention kernels, or ``None`` when no SGLang source is available."""
    found = _installed()
    if found is not None:
        return found
    directory = _source_dir()
    return None if directory is None else _from_files(directory)
