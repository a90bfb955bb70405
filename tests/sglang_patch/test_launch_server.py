"""Flag handling and the patched-build check of ``python -m akv.system.launch_server``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from akv.system import launch_server as ls
from akv.system.adapter import live_guard

ROOT = Path(__file__).resolve().parents[2]


CPU = ls.Machine(cuda=False, flashinfer=False)
CUDA = ls.Machine(cuda=True, flashinfer=True)


def test_defaults_are_added_and_other_flags_pass_through_in_order() -> None:
    argv = ["--model-path", "/m", "--port", "30001", "--tool-call-parser", "qwen"]
    assert ls.apply_akv_defaults(argv, CPU) == argv + ["--page-size", "1", "--attention-backend", "triton",
                                                       "--radix-cache-backend", "akv", "--disable-hybrid-swa-memory"]


def backend(argv: list[str]) -> str:
    """The attention backend SGLang's parser ends up with: the last value given."""
    return ls._flag_value(argv, "--attention-backend")


def test_flashinfer_is_the_default_on_cuda_with_flashinfer_installed() -> None:
    assert backend(ls.apply_akv_defaults(["--model-path", "/m"], CUDA)) == "flashinfer"
    assert backend(ls.apply_akv_defaults(["--model-path", "/m", "--device", "cuda"], CUDA)) == "flashinfer"


@pytest.mark.parametrize("given", ["triton", "flashinfer"])
def test_an_explicit_attention_backend_wins(given: str) -> None:
    for machine in (CPU, CUDA):
        out = ls.apply_akv_defaults(["--model-path", "/m", f"--attention-backend={given}"], machine)
        assert backend(out) == given and sum(a.startswith("--attention-backend") for a in out) == 1


@pytest.mark.parametrize(("argv", "machine"), [
    (["--model-path", "/m"], CPU),
    (["--model-path", "/m"], ls.Machine(cuda=True, flashinfer=False)),
    (["--model-path", "/m"], ls.Machine(cuda=False, flashinfer=True)),
    (["--model-path", "/m", "--device", "cpu"], CUDA),
    (["--model-path", "/m", "--device=xpu"], CUDA),
])
def test_triton_where_flashinfer_cannot_run(argv: list[str], machine: ls.Machine) -> None:
    assert backend(ls.apply_akv_defaults(argv, machine)) == "triton"


HOPPER = ls.Machine(cuda=True, flashinfer=True, fa3=True)


@pytest.mark.parametrize("flag", ["--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"])
def test_fa3_is_taken_on_a_cuda_device_that_runs_it_and_flashinfer_stays_the_default(flag: str) -> None:
    out = ls.apply_akv_defaults(["--model-path", "/m", flag, "fa3"], HOPPER)
    assert ls._flag_value(out, flag) == "fa3" and out.count("fa3") == 1
    assert backend(ls.apply_akv_defaults(["--model-path", "/m"], HOPPER)) == "flashinfer"
    assert backend(ls.apply_akv_defaults(["--model-path", "/m", "--device", "cuda", "--attention-backend=fa3"],
                                         HOPPER)) == "fa3"


@pytest.mark.parametrize(("argv", "machine", "where"), [
    (["--attention-backend", "fa3"], CPU, "this machine has none"),
    (["--attention-backend=fa3"], CUDA, "this machine has none"),  # a CUDA device FA3 does not run on
    (["--decode-attention-backend", "fa3"], ls.Machine(cuda=False, flashinfer=True, fa3=False), "this machine has none"),
    (["--attention-backend", "fa3", "--device", "cpu"], HOPPER, "--device cpu"),
])
def test_fa3_is_refused_where_it_cannot_run_naming_the_backends_that_can(argv, machine, where) -> None:
    with pytest.raises(ls.LaunchError) as info:
        ls.apply_akv_defaults(["--model-path", "/m", *argv], machine)
    flag = argv[0].partition("=")[0]
    assert str(info.value) == (f"{flag} 'fa3' needs a CUDA device of compute capability 8.x or 9.x ({where}); "
                               f"use {flag} triton or flashinfer")


def test_triton_for_a_model_with_sliding_window_layers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "layer_types": '
                                          '["sliding_attention", "full_attention"]}')
    assert backend(ls.apply_akv_defaults(["--model-path", str(tmp_path)], CUDA)) == "triton"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "sliding_window": null}')
    assert backend(ls.apply_akv_defaults(["--model-path", str(tmp_path)], CUDA)) == "flashinfer"


@pytest.mark.parametrize(
    "argv",
    [
        ["--page-size", "1", "--attention-backend", "triton", "--radix-cache-backend", "akv"],
        ["--page-size=1", "--attention-backend=triton", "--radix-cache-backend=akv"],
        ["--attention-backend", "triton", "--decode-attention-backend", "triton", "--page-size", "1",
         "--radix-cache-backend", "akv"],
        ["--attention-backend", "flashinfer", "--page-size", "1", "--radix-cache-backend", "akv"],
    ],
)
def test_agreeing_flags_are_kept_once(argv: list[str]) -> None:
    given = [*argv, "--disable-hybrid-swa-memory"]
    out = ls.apply_akv_defaults(["--model-path", "/m", *given], CUDA)
    assert out == ["--model-path", "/m", *given]


def test_a_value_on_the_hybrid_swa_switch_is_refused() -> None:
    with pytest.raises(ls.LaunchError, match="--disable-hybrid-swa-memory is a switch"):
        ls.apply_akv_defaults(["--model-path", "/m", "--disable-hybrid-swa-memory=false"])


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["--page-size", "16"], "--page-size", "16"),
        (["--page-size=64"], "--page-size", "64"),
        (["--attention-backend", "torch_native"], "--attention-backend", "torch_native"),
        (["--attention-backend=fa4"], "--attention-backend", "fa4"),
        (["--prefill-attention-backend", "trtllm_mha"], "--prefill-attention-backend", "trtllm_mha"),
        (["--decode-attention-backend", "fa4"], "--decode-attention-backend", "fa4"),
        (["--page-size", "1", "--page-size", "4"], "--page-size", "4"),
        (["--radix-cache-backend", "lru"], "--radix-cache-backend", "lru"),
    ],
)
def test_conflicting_flags_are_refused_naming_flag_and_value(argv: list[str], flag: str, value: str) -> None:
    with pytest.raises(ls.LaunchError) as info:
        ls.apply_akv_defaults(["--model-path", "/m", *argv])
    assert f"{flag} '{value}' conflicts with AKV" in str(info.value)


@pytest.mark.parametrize("argv", [["--page-size"], ["--attention-backend", "--port", "1"]])
def test_flag_without_value_is_refused(argv: list[str]) -> None:
    with pytest.raises(ls.LaunchError, match="missing value"):
        ls.apply_akv_defaults(argv)


def test_protect_live_is_taken_out_of_sglangs_flags_and_set_for_the_servers_processes() -> None:
    argv = ["--model-path", "/m", "--akv-protect-live", "--port", "30001"]
    assert ls.take_akv_switches(argv) == (["--model-path", "/m", "--port", "30001"], {"AKV_PROTECT_LIVE": "1"})
    assert ls.take_akv_switches(["--model-path", "/m"]) == (["--model-path", "/m"], {})
    assert live_guard.enabled({"AKV_PROTECT_LIVE": "1"}) and not live_guard.enabled({})
    assert not live_guard.enabled({"AKV_PROTECT_LIVE": "0"})
    with pytest.raises(ValueError, match="AKV_PROTECT_LIVE: 'yes' is not 0 or 1"):
        live_guard.enabled({"AKV_PROTECT_LIVE": "yes"})


def test_protect_live_takes_no_value_and_needs_the_akv_cache() -> None:
    with pytest.raises(ls.LaunchError, match="--akv-protect-live is a switch and takes no value, got 'true'"):
        ls.take_akv_switches(["--model-path", "/m", "--akv-protect-live=true"])
    with pytest.raises(ls.LaunchError, match="--akv-protect-live conflicts with --disaggregation-mode decode"):
        ls.take_akv_switches(["--akv-protect-live", "--disaggregation-mode", "decode"])


def test_help_describes_protect_live_and_says_it_is_opt_in() -> None:
    text = ls.usage("0.5.16+akv")
    assert "[--akv-protect-live]" in text and "``--akv-protect-live`` (off by default)" in text
    assert "Opt-in until it is measured on a GPU" in " ".join(text.split())


def test_parsed_server_args_are_checked_too() -> None:
    ok = SimpleNamespace(page_size=1, attention_backend="triton", prefill_attention_backend=None,
                         decode_attention_backend="triton", radix_cache_backend="akv", chunked_prefill_size=None,
                         disable_radix_cache=False, disable_hybrid_swa_memory=True, disaggregation_mode="null")
    ls.check_server_args(ok)
    ls.check_server_args(SimpleNamespace(**{**vars(ok), "attention_backend": "flashinfer",
                                            "decode_attention_backend": "flashinfer"}))
    ls.check_server_args(SimpleNamespace(**{**vars(ok), "attention_backend": "fa3", "decode_attention_backend": "fa3"}))
    for field, value, flag in [
        ("page_size", 4, "--page-size"),
        ("attention_backend", "fa4", "--attention-backend"),
        ("attention_backend", None, "--attention-backend"),
        ("prefill_attention_backend", "trtllm_mha", "--prefill-attention-backend"),
        ("decode_attention_backend", "torch_native", "--decode-attention-backend"),
    ]:
        bad = SimpleNamespace(**{**vars(ok), field: value})
        with pytest.raises(ls.LaunchError, match=f"{flag} {value!r} conflicts"):
            ls.check_server_args(bad)
    for field, value, message in [
        ("chunked_prefill_size", -1, "--chunked-prefill-size -1 conflicts with AKV"),
        ("disable_radix_cache", True, "--disable-radix-cache conflicts with AKV"),
        ("disable_hybrid_swa_memory", False, "disable_hybrid_swa_memory False conflicts with AKV"),
    ]:
        with pytest.raises(ls.LaunchError, match=message):
            ls.check_server_args(SimpleNamespace(**{**vars(ok), field: value}))


@pytest.mark.parametrize(
    ("version", "message"),
    [(None, "sglang is not installed"), ("0.5.16", "sglang 0.5.16 is not the AKV build")],
)
def test_unpatched_sglang_is_refused_with_the_build_command(version: str | None, message: str) -> None:
    with pytest.raises(ls.LaunchError) as info:
        ls.check_patched(version)
    assert message in str(info.value) and ls.BUILD_COMMAND in str(info.value)
    ls.check_patched("0.5.16+akv")


def test_the_missing_sglang_hint_names_the_whole_install() -> None:
    with pytest.raises(ls.LaunchError) as info:
        ls.check_patched(None)
    text = str(info.value)
    install, build = text.index('pip install "sglang==0.5.16" -e ".[system]"'), text.index(ls.BUILD_COMMAND)
    assert install < build


def test_version_is_read_from_the_package_without_importing_it(tmp_path: Path) -> None:
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.5.16+akv'\n__version_tuple__ = (0, 5, 16)\n")
    script = "from akv.system.launch_server import installed_sglang_version as v; print(v())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip() == "0.5.16+akv", done.stderr


def test_cli_exits_with_message_when_sglang_is_stock(tmp_path: Path) -> None:
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text("__version__ = version = '0.5.16'\n")
    done = subprocess.run([sys.executable, "-m", "akv.system.launch_server", "--model-path", "/m"],
                          capture_output=True, text=True, cwd=ROOT, check=False,
                          env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert "not the AKV build" in done.stderr and ls.BUILD_COMMAND in done.stderr


# ---------------------------------------------------------------- PD: Mooncake's transfer engine ---

def _pd(mode: str, backend: str = "mooncake") -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend=backend)


def _fails(error: BaseException):
    def load() -> None:
        raise error
    return load


def test_the_engine_is_loaded_only_for_a_pd_server_over_mooncake() -> None:
    calls = []
    for args in (_pd("null"), _pd("prefill", "nixl"), _pd("decode", "fake")):
        ls.check_transfer_engine(args, load=lambda: calls.append(1))
    assert calls == []
    for args in (_pd("prefill"), _pd("decode"), _pd("prefill", "mooncake_tcp")):
        ls.check_transfer_engine(args, load=lambda: calls.append(1))
    assert calls == [1, 1, 1]


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"),
         'which is not installed: python -m pip install -e ".[pd]"'),
        (ModuleNotFoundError("No module named 'msgpack'", name="msgpack"), "which cannot import msgpack"),
        (ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
         "cannot load: libibverbs.so.1: cannot open shared object file: No such file or directory; install "
         "Debian/Ubuntu packages libibverbs1 and ibverbs-providers"),
        (ImportError("libcuda.so.1: cannot open shared object file: No such file or directory"),
         "install the NVIDIA driver"),
        (ImportError("engine.so: undefined symbol: _ZN4glog\nsecond line"),
         'cannot load: engine.so: undefined symbol: _ZN4glog; reinstall it with python -m pip install -e ".[pd]"'),
    ],
)
def test_a_missing_engine_is_named_in_one_line(error: BaseException, says: str) -> None:
    with pytest.raises(ls.LaunchError) as info:
        ls.check_transfer_engine(_pd("decode"), load=_fails(error))
    text = str(info.value)
    assert "\n" not in text and text.startswith("--disaggregation-mode decode needs Mooncake's transfer engine")
    assert says in text


_LAUNCH_CHECKS = """
import sys
from types import SimpleNamespace
from akv.system import launch_server as ls
for folder in sys.argv[1:]:
    sys.path.insert(0, folder)
    try:
        ls.check_transfer_engine(SimpleNamespace(disaggregation_mode="prefill",
                                                 disaggregation_transfer_backend="mooncake_tcp"))
        print("loaded")
    except ls.LaunchError as exc:
        print(exc)
    sys.path.remove(folder)
    for name in [m for m in sys.modules if m.split(".")[0] == "mooncake"]:
        del sys.modules[name]
"""


@pytest.mark.slow
def test_the_real_loader_imports_mooncake_engine(tmp_path: Path) -> None:
    """Through the real import, in one fresh process: a ``mooncake`` without its engine, an engine
    whose shared library does not load (as ``engine.so`` does without libibverbs), one that loads."""
    engines = [None, "import ctypes\nctypes.CDLL('libakv_absent_for_test.so.1')\n", "class TransferEngine: pass\n"]
    folders = []
    for i, source in enumerate(engines):
        pkg = tmp_path / str(i) / "mooncake"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        if source is not None:
            (pkg / "engine.py").write_text(source)
        folders.append(str(tmp_path / str(i)))
    done = subprocess.run([sys.executable, "-c", _LAUNCH_CHECKS, *folders], capture_output=True, text=True,
                          check=False, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr
    missing, broken, fine = done.stdout.strip().splitlines()
    assert "which is not installed" in missing
    assert "cannot load: libakv_absent_for_test.so.1" in broken
    assert fine == "loaded"


# ---------------------------------------------------------------- PD: the decode server's cache ---

def test_a_decode_server_gets_no_akv_radix_cache() -> None:
    """SGLang gives a PD decode server its chunk cache (it receives KV, computes no prompt): the
    launcher adds no --radix-cache-backend there and refuses one given; a prefill server gets AKV's."""
    decode = ["--model-path", "/m", "--disaggregation-mode", "decode"]
    assert ls.apply_akv_defaults(decode, CPU) == decode + ["--page-size", "1", "--attention-backend", "triton",
                                                           "--disable-hybrid-swa-memory"]
    prefill = ["--model-path", "/m", "--disaggregation-mode=prefill"]
    assert ls._flag_value(ls.apply_akv_defaults(prefill, CPU), "--radix-cache-backend") == "akv"
    with pytest.raises(ls.LaunchError, match="--radix-cache-backend conflicts with --disaggregation-mode decode"):
        ls.apply_akv_defaults(decode + ["--radix-cache-backend", "akv"], CPU)


def test_parsed_args_of_a_decode_server_accept_sglang_s_chunk_cache() -> None:
    parsed = dict(page_size=1, attention_backend="triton", prefill_attention_backend=None,
                  decode_attention_backend=None, chunked_prefill_size=8192, disable_hybrid_swa_memory=True)
    ls.check_server_args(SimpleNamespace(**parsed, radix_cache_backend=None, disable_radix_cache=True,
                                         disaggregation_mode="decode"))
    with pytest.raises(ls.LaunchError, match="conflicts with --disaggregation-mode decode"):
        ls.check_server_args(SimpleNamespace(**parsed, radix_cache_backend="akv", disable_radix_cache=True,
                                             disaggregation_mode="decode"))
    with pytest.raises(ls.LaunchError, match="--disable-radix-cache conflicts with AKV"):
        ls.check_server_args(SimpleNamespace(**parsed, radix_cache_backend="akv", disable_radix_cache=True,
                                             disaggregation_mode="prefill"))


_PARSE_PD = """
import sys
import cpu_shim
cpu_shim.install()
from akv.system import launch_server as ls
from sglang.srt.server_args import prepare_server_args
model = sys.argv[1]
for mode in ("prefill", "decode"):
    argv = ls.apply_akv_defaults(["--model-path", model, "--device", "cpu", "--disaggregation-mode", mode,
                                  "--disaggregation-transfer-backend", "mooncake_tcp"], ls.Machine(False, False))
    args = prepare_server_args(argv)
    try:
        ls.check_server_args(args)
        print(mode, "ok", args.radix_cache_backend, args.disable_radix_cache)
    except ls.LaunchError as exc:
        print(mode, "refused:", exc)
"""


@pytest.mark.slow
def test_sglang_s_own_parser_gives_pd_servers_args_the_launcher_accepts(patched_site: Path, tmp_path: Path) -> None:
    """SGLang's ``prepare_server_args`` (the patched build, CPU) turns a decode server's radix cache off
    itself; the launcher accepts both servers' parsed arguments (it refused the decode server's)."""
    from akv.system.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", arch="qwen3", seed=3)
    here = ROOT / "tests" / "sglang_patch"
    done = subprocess.run([sys.executable, "-c", _PARSE_PD, str(model)], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_site), str(ROOT), str(here)])},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("prefill ", "decode "))]
    assert lines == ["prefill ok akv False", "decode ok None True"], done.stdout[-3000:]
