"""Start the patched SGLang server with the settings AKV's first configuration needs.

``python -m akv.system.launch_server [SGLang flags]`` checks that the installed SGLang is the AKV
build, adds ``--page-size 1``, ``--attention-backend``, ``--radix-cache-backend akv`` and
``--disable-hybrid-swa-memory`` unless given (the attention backend is ``flashinfer`` on a CUDA
device with FlashInfer installed and a model without sliding-window layers, ``triton`` elsewhere;
``--attention-backend fa3`` is taken where FA3 runs: a CUDA device of compute capability 8.x or 9.x),
refuses flags that contradict them (and a disabled radix cache or chunked prefill), and hands every
flag to SGLang's own launcher. Give the model's ``--reasoning-parser`` (e.g. ``qwen3``) for the
Anthropic ``clear_thinking_20251015`` edit on ``/v1/messages``: without one SGLang leaves earlier
thinking blocks out of the prompt, and the edit on a conversation that has them is refused (400).
A PD server (``--disaggregation-mode prefill|decode`` over Mooncake) loads Mooncake's transfer engine
first and, when it cannot, says in one line what is missing; a decode server keeps the cache SGLang
gives it (no ``--radix-cache-backend akv``). PD servers serve plain requests only (context requests
are refused until AKV's PD hooks exist: README, PD section).

AKV's own switch, taken out before SGLang parses the rest and passed to the server's processes as
``AKV_PROTECT_LIVE=1``: ``--akv-protect-live`` (off by default). While requests are in flight, a
request waits in the queue rather than evict KV that a conversation still reads (only KV of dropped
messages and stale positions that no request holds counts as evictable to admission, and eviction
frees only what an allocation lacks); an idle server admits as without it. Opt-in until it is measured
on a GPU: the replay simulator (``bench/simulate.py --protect-live``) shows it removes the collapse of
a pool that cannot hold every conversation's live KV plus the requests in flight (browse at
concurrency 16 on a 600k pool: 111k tokens prefilled per call without it, 3.9k with it).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from akv import __version__ as akv_version
from akv.system.adapter import live_guard
from akv.system.adapter.serving import ATTENTION_BACKENDS, REQUIRED_PAGE_SIZE, REQUIRED_RADIX_CACHE_BACKEND

PATCHED_SUFFIX = "+akv"
BUILD_COMMAND = "python -m akv.system._build --out dist --install"
INSTALL_COMMAND = (f'python -m pip install "sglang==0.5.16" -e ".[system]" (from the AKV checkout), '
                   f"then {BUILD_COMMAND}")

AKV_DEFAULTS: dict[str, str] = {
    "--page-size": str(REQUIRED_PAGE_SIZE),
    "--attention-backend": ATTENTION_BACKENDS[0],
    "--radix-cache-backend": REQUIRED_RADIX_CACHE_BACKEND,
}
"""Flags added when absent (``--attention-backend``: see :func:`default_attention_backend`)."""

ALLOWED: dict[str, tuple[str, ...]] = {
    "--page-size": (str(REQUIRED_PAGE_SIZE),),
    "--attention-backend": ATTENTION_BACKENDS,
    "--radix-cache-backend": (REQUIRED_RADIX_CACHE_BACKEND,),
    "--prefill-attention-backend": ATTENTION_BACKENDS,
    "--decode-attention-backend": ATTENTION_BACKENDS,
}
"""Flags that may be given but only with one of these values."""

AKV_SWITCHES: tuple[str, ...] = ("--disable-hybrid-swa-memory",)
"""Switches added when absent. Hybrid SWA memory (gpt-oss's default) frees the KV of sliding-layer
keys that left the window, which a Drop brings back into it."""

AKV_OWN_SWITCHES: dict[str, str] = {live_guard.FLAG: live_guard.ENV}
"""AKV's switches (SGLang does not know them): taken out of the flags, each sets its environment
variable to ``1`` for the server's processes (:func:`take_akv_switches`)."""

DECODE_RADIX_CACHE = ("--radix-cache-backend conflicts with --disaggregation-mode decode: a decode server keeps "
                      "SGLang's own cache (it receives KV and computes no prompt; leave the flag out)")

FA3 = "fa3"
_BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")

_SERVER_ARGS_FIELDS: dict[str, str] = {flag: flag[2:].replace("-", "_") for flag in ALLOWED}


class LaunchError(RuntimeError):
    """The server cannot be started as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Machine:
    """What decides the attention backend: a CUDA device, FlashInfer installed, and whether the device
    runs FA3 (compute capability 8.x or 9.x, what SGLang's ``fa3`` backend asks of a non-MLA model)."""

    cuda: bool
    flashinfer: bool
    fa3: bool = False

    @classmethod
    def detect(cls) -> Machine:
        """This machine (imports torch, as SGLang's launcher does anyway)."""
        flashinfer = importlib.util.find_spec("flashinfer") is not None
        try:
            import torch
        except ImportError:
            return cls(cuda=False, flashinfer=flashinfer)
        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, flashinfer=flashinfer, fa3=cuda and torch.cuda.get_device_capability()[0] in (8, 9))


def default_attention_backend(argv: list[str], machine: Machine) -> str:
    """``flashinfer`` (the faster backend, with CUDA graphs for context decode) on a CUDA device with
    FlashInfer installed, unless ``--device`` names another device or the local model has
    sliding-window layers (AKV's window lists are built for triton); ``triton`` otherwise."""
    device = _flag_value(argv, "--device")
    if device is not None and device != "cuda" or not (machine.cuda and machine.flashinfer):
        return "triton"
    return "triton" if _has_sliding_layers(_flag_value(argv, "--model-path")) else "flashinfer"


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag value`` or ``--flag=value``)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def _has_sliding_layers(model_path: str | None) -> bool:
    """Whether the local model's ``config.json`` declares sliding-window layers (a hub name or a
    folder without a readable config counts as none)."""
    if model_path is None:
        return False
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    layer_types = config.get("layer_types") if isinstance(config, dict) else None
    return isinstance(layer_types, list) and "sliding_attention" in layer_types


def installed_sglang_version() -> str | None:
    """``sglang.__version__`` as written in the installed package, read without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        version_py = Path(folder) / "_version.py"
        if version_py.is_file():
            return _version_from_source(version_py.read_text(encoding="utf-8"))
    return None


def _version_from_source(source: str) -> str | None:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if "__version__" in names and isinstance(node.value.value, str):
                return node.value.value
    return None


def check_patched(version: str | None) -> None:
    """Raise LaunchError unless ``version`` is an AKV build of SGLang."""
    if version is None:
        raise LaunchError(f"sglang is not installed; install it and the AKV build with: {INSTALL_COMMAND}")
    if not version.endswith(PATCHED_SUFFIX):
        raise LaunchError(
            f"the installed sglang {version} is not the AKV build (version must end with {PATCHED_SUFFIX!r}); "
            f"build and install it with: {BUILD_COMMAND}"
        )


def take_akv_switches(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without AKV's own switches, and the environment they set; LaunchError for a switch
    given a value, or given to a PD decode server (it keeps SGLang's cache, not AKV's)."""
    rest: list[str] = []
    env: dict[str, str] = {}
    for arg in argv:
        flag, sep, value = arg.partition("=")
        if flag not in AKV_OWN_SWITCHES:
            rest.append(arg)
            continue
        if sep:
            raise LaunchError(f"{flag} is a switch and takes no value, got {value!r}")
        env[AKV_OWN_SWITCHES[flag]] = "1"
    if env and _flag_value(rest, "--disaggregation-mode") == "decode":
        raise LaunchError(f"{', '.join(f for f in AKV_OWN_SWITCHES if f in argv)} conflicts with --disaggregation-mode "
                          "decode: a decode server keeps SGLang's own cache (leave the flag out)")
    return rest, env


def apply_akv_defaults(argv: list[str], machine: Machine | None = None) -> list[str]:
    """``argv`` plus the AKV defaults it lacks (the attention backend chosen for ``machine``, by
    default this one); LaunchError when a flag contradicts AKV."""
    given: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, sep, value = arg.partition("=")
        if flag in AKV_SWITCHES and sep:
            raise LaunchError(f"{flag} is a switch and takes no value, got {value!r}")
        if flag in ALLOWED:
            if not sep:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise LaunchError(f"{flag}: missing value (AKV needs {_choices(flag)})")
                value = argv[i + 1]
                i += 1
            _require(flag, value)
            given[flag] = value
        i += 1
    defaults = dict(AKV_DEFAULTS)
    if _flag_value(argv, "--disaggregation-mode") == "decode":
        if "--radix-cache-backend" in given:
            raise LaunchError(DECODE_RADIX_CACHE)
        del defaults["--radix-cache-backend"]
    if "--attention-backend" not in given:
        machine = machine or Machine.detect()
        defaults["--attention-backend"] = default_attention_backend(argv, machine)
    for flag in (f for f, value in given.items() if value == FA3 and f in _BACKEND_FLAGS):
        machine = machine or Machine.detect()
        device = _flag_value(argv, "--device")
        if not machine.fa3 or device not in (None, "cuda"):
            where = f"--device {device}" if device not in (None, "cuda") else "this machine has none"
            raise LaunchError(f"{flag} {FA3!r} needs a CUDA device of compute capability 8.x or 9.x ({where}); "
                              f"use {flag} {' or '.join(b for b in ATTENTION_BACKENDS if b != FA3)}")
    missing = [item for flag, value in defaults.items() if flag not in given for item in (flag, value)]
    switches = [flag for flag in AKV_SWITCHES if flag not in argv]
    return list(argv) + missing + switches


def _require(flag: str, value: Any) -> None:
    if str(value) not in ALLOWED[flag]:
        raise LaunchError(
            f"{flag} {value!r} conflicts with AKV: drop/reposition need {flag} {_choices(flag)} "
            f"(leave the flag out to get AKV's default)"
        )


def _choices(flag: str) -> str:
    return " or ".join(ALLOWED[flag])


def check_server_args(server_args: Any) -> None:
    """Check SGLang's parsed arguments (catches abbreviated flags and ``--config`` files): the
    required values, chunked prefill on (segments run as chunked-prefill rounds), a radix cache
    (on a PD decode server: SGLang's own cache, as SGLang decides, and not AKV's)."""
    decode = server_args.disaggregation_mode == "decode"
    for flag, field in _SERVER_ARGS_FIELDS.items():
        value = getattr(server_args, field)
        if decode and flag == "--radix-cache-backend":
            if value is not None:
                raise LaunchError(DECODE_RADIX_CACHE)
            continue
        if value is None and flag not in AKV_DEFAULTS:
            continue
        _require(flag, value)
    chunk = server_args.chunked_prefill_size
    if chunk is not None and chunk <= 0:
        raise LaunchError(f"--chunked-prefill-size {chunk} conflicts with AKV: context requests run as "
                          "chunked-prefill rounds (leave the flag out or give a positive size)")
    if server_args.disable_radix_cache and not decode:
        raise LaunchError("--disable-radix-cache conflicts with AKV: every request is served from its radix cache")
    if not server_args.disable_hybrid_swa_memory:
        raise LaunchError("disable_hybrid_swa_memory False conflicts with AKV: hybrid SWA memory frees sliding-layer "
                          "KV that a Drop brings back into the window (give --disable-hybrid-swa-memory)")


PD_INSTALL_COMMAND = 'python -m pip install -e ".[pd]"'
MOONCAKE_BACKENDS = ("mooncake", "mooncake_tcp")
_SYSTEM_LIBRARIES = {
    "libibverbs.so.1": "Debian/Ubuntu packages libibverbs1 and ibverbs-providers",
    "libmlx5.so.1": "Debian/Ubuntu packages libibverbs1 and ibverbs-providers",
    "libnuma.so.1": "Debian/Ubuntu package libnuma1",
    "libcurl.so.4": "Debian/Ubuntu package libcurl4",
    "libcuda.so.1": "the NVIDIA driver",
    "libcudart.so.13": "the CUDA 13 runtime (libcudart.so.13 on the library path)",
}
"""Shared libraries Mooncake's ``engine.so`` needs that its wheel does not bundle, and where they come from."""


def load_transfer_engine() -> None:
    """Import Mooncake's transfer engine as SGLang does (torch first: it loads the CUDA runtime)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    importlib.import_module("mooncake.engine")


def check_transfer_engine(server_args: Any, load: Callable[[], None] = load_transfer_engine) -> None:
    """LaunchError, one line naming what is missing, when a PD server (``--disaggregation-mode
    prefill|decode`` over Mooncake) cannot load Mooncake's transfer engine."""
    mode, backend = server_args.disaggregation_mode, server_args.disaggregation_transfer_backend
    if mode not in ("prefill", "decode") or backend not in MOONCAKE_BACKENDS:
        return
    needs = f"--disaggregation-mode {mode} needs Mooncake's transfer engine (mooncake.engine)"
    try:
        load()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "mooncake":
            raise LaunchError(f"{needs}, which cannot import {exc.name}: {PD_INSTALL_COMMAND}") from exc
        raise LaunchError(f"{needs}, which is not installed: {PD_INSTALL_COMMAND}") from exc
    except (ImportError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        library = next((lib for lib in _SYSTEM_LIBRARIES if lib in reason), None)
        fix = (f"install {_SYSTEM_LIBRARIES[library]}" if library is not None
               else f"reinstall it with {PD_INSTALL_COMMAND}")
        raise LaunchError(f"{needs}, which cannot load: {reason}; {fix}") from exc


def usage(version: str | None) -> str:
    """The launcher's own help: what it adds, and where the rest of the flags are described."""
    added = ", ".join(f"{flag} {value}" for flag, value in AKV_DEFAULTS.items() if flag != "--attention-backend")
    sglang = ("SGLang's flags follow (python -m sglang.launch_server --help)." if version is not None else
              f"SGLang is not installed, so its flags are not listed; install with: {INSTALL_COMMAND}")
    return (f"usage: akv-server [{' '.join(AKV_OWN_SWITCHES)}] [SGLang flags] (or python -m akv.system.launch_server)"
            f"\n\n{__doc__.strip()}\n\n"
            f"Added unless given (default: {added}, {' '.join(AKV_SWITCHES)}, --attention-backend "
            f"flashinfer on CUDA with FlashInfer installed, else triton; on this machine "
            f"{default_attention_backend([], Machine.detect())}). --attention-backend fa3 is taken on a CUDA "
            f"device of compute capability 8.x or 9.x.\n{sglang}\n")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    version = installed_sglang_version()
    if "--version" in args:
        print(f"akv {akv_version}; sglang {version or 'not installed'}")
        return 0
    if "-h" in args or "--help" in args:
        print(usage(version), flush=True)
        if version is None or not version.endswith(PATCHED_SUFFIX):
            return 0
    try:
        check_patched(version)
        args, akv_env = take_akv_switches(args)
        args = apply_akv_defaults(args)
    except LaunchError as exc:
        print(f"akv.system.launch_server: {exc}", file=sys.stderr)
        return 2

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args(args)
    try:
        check_server_args(server_args)
        check_transfer_engine(server_args)
    except LaunchError as exc:
        print(f"akv.system.launch_server: {exc}", file=sys.stderr)
        return 2
    os.environ.update(akv_env)

    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
