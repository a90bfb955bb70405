"""The real build against the pinned PyPI wheel: output layout, RECORD, idempotence, refusals."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import shutil
import zipfile
from pathlib import Path

import pytest

from akv.system import _build

PATCHED_FILES = {
    "sglang/_version.py",
    "sglang/srt/disaggregation/decode.py",
    "sglang/srt/disaggregation/prefill.py",
    "sglang/srt/entrypoints/anthropic/protocol.py",
    "sglang/srt/entrypoints/anthropic/serving.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/entrypoints/openai/protocol.py",
    "sglang/srt/entrypoints/openai/serving_base.py",
    "sglang/srt/entrypoints/openai/serving_chat.py",
    "sglang/srt/layers/attention/flashattention_backend.py",
    "sglang/srt/layers/attention/flashinfer_backend.py",
    "sglang/srt/layers/attention/triton_backend.py",
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/managers/schedule_batch.py",
    "sglang/srt/managers/schedule_policy.py",
    "sglang/srt/managers/scheduler.py",
    "sglang/srt/managers/scheduler_components/output_streamer.py",
    "sglang/srt/managers/tokenizer_manager.py",
    "sglang/srt/mem_cache/kv_cache_configurator.py",
    "sglang/srt/mem_cache/registry.py",
    "sglang/srt/model_executor/forward_batch_info.py",
    "sglang/srt/model_executor/model_runner.py",
    "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py",
}


def _entries(wheel: Path) -> dict[str, bytes]:
    """File entries (directory entries carry nothing: the stock wheel has no empty folders)."""
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist() if not name.endswith("/")}


def test_stock_wheel_matches_its_pin(stock_wheel: Path, tag: str) -> None:
    digest = hashlib.sha256(stock_wheel.read_bytes()).hexdigest()
    assert digest == {"cp311": "d5f345a18953dd35df568ac56bdcb7f5ee910ab39efea4469b714556d1070713",
                      "cp312": "b8ed16e72c7d6a643e31ba52e3ff106439e9dbb78543950e4c810158b826ea8e"}[tag]


def test_output_differs_from_stock_only_where_patched(patched: _build.BuildResult, stock_wheel: Path, tag: str) -> None:
    assert patched.wheel.name == f"sglang-0.5.16+akv-{tag}-{tag}-manylinux_2_34_x86_64.whl"
    assert set(patched.changed_files) == PATCHED_FILES
    stock, out = _entries(stock_wheel), _entries(patched.wheel)
    stock_info, out_info = "sglang-0.5.16.dist-info/", "sglang-0.5.16+akv.dist-info/"
    stock_body = {k: v for k, v in stock.items() if not k.startswith(stock_info)}
    out_body = {k: v for k, v in out.items() if not k.startswith(out_info)}
    assert set(out_body) == set(stock_body)
    assert {k for k in out_body if out_body[k] != stock_body[k]} == PATCHED_FILES
    assert b"__version__ = version = '0.5.16+akv'" in out["sglang/_version.py"]
    meta = out[out_info + "METADATA"].decode().splitlines()
    assert "Version: 0.5.16+akv" in meta and "Name: sglang" in meta
    assert meta == [("Version: 0.5.16+akv" if line == "Version: 0.5.16" else line)
                    for line in stock[stock_info + "METADATA"].decode().splitlines()]
    for name in ("WHEEL", "entry_points.txt", "top_level.txt"):
        assert out[out_info + name] == stock[stock_info + name]


def test_record_lists_every_file_with_its_hash(patched: _build.BuildResult) -> None:
    entries = _entries(patched.wheel)
    record_name = "sglang-0.5.16+akv.dist-info/RECORD"
    rows = list(csv.reader(io.StringIO(entries[record_name].decode())))
    assert {row[0] for row in rows} == set(entries)
    for path, digest, size in rows:
        if path == record_name:
            assert digest == "" and size == ""
            continue
        data = entries[path]
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}" and int(size) == len(data), path


def test_installed_files_keep_stock_modes(patched: _build.BuildResult, stock_wheel: Path) -> None:
    with zipfile.ZipFile(stock_wheel) as s, zipfile.ZipFile(patched.wheel) as p:
        stock_modes = {i.filename: (i.external_attr >> 16) & 0o111 for i in s.infolist()}
        for info in p.infolist():
            if info.filename in stock_modes:
                assert bool((info.external_attr >> 16) & 0o111) == bool(stock_modes[info.filename]), info.filename


def test_pip_installs_the_wheel(patched_site: Path) -> None:
    info = patched_site / "sglang-0.5.16+akv.dist-info"
    assert (info / "METADATA").is_file() and (info / "RECORD").is_file()
    assert "akv_protocol.note_unknown_fields" in (
        patched_site / "sglang/srt/entrypoints/openai/protocol.py").read_text()


def test_patched_sources_compile(patched: _build.BuildResult) -> None:
    entries = _entries(patched.wheel)
    for rel in patched.changed_files:
        compile(entries[rel], rel, "exec")


def test_rebuild_is_skipped_and_fresh_builds_are_byte_identical(
    patched: _build.BuildResult, tag: str, tmp_path: Path
) -> None:
    again = _build.build(patched.wheel.parent, tag)
    assert again.skipped and again.changed_files == patched.changed_files
    fresh = _build.build(tmp_path, tag)
    assert not fresh.skipped
    assert fresh.wheel.read_bytes() == patched.wheel.read_bytes()


def test_changed_inputs_rebuild_and_overlay_files_are_added(
    patched: _build.BuildResult, tag: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(patched.wheel, out / patched.wheel.name)
    patch = tmp_path / "changed.patch"
    patch.write_text(_build.PATCH_FILE.read_text().replace(
        "+    drop_message: Optional[Any] = None",
        "+    drop_message: Optional[Any] = None  # changed"))
    overlay = tmp_path / "overlay"
    (overlay / "sglang" / "srt").mkdir(parents=True)
    (overlay / "sglang" / "srt" / "akv_marker.py").write_text("MARK = 1\n")
    result = _build.build(out, tag, patch_file=patch, overlay=overlay)
    assert not result.skipped
    entries = _entries(result.wheel)
    assert b"= None  # changed" in entries["sglang/srt/entrypoints/openai/protocol.py"]
    assert entries["sglang/srt/akv_marker.py"] == b"MARK = 1\n"
    assert set(result.changed_files) == PATCHED_FILES | {"sglang/srt/akv_marker.py"}
    exported = _build.export_overlay(result, tmp_path / "site-overlay")
    assert set(exported) == set(result.changed_files)
    for rel in exported:
        assert (tmp_path / "site-overlay" / rel).read_bytes() == entries[rel]
    assert _build.build(out, tag, patch_file=patch, overlay=overlay).skipped


def test_overlay_export_refuses_a_folder_with_other_files(patched: _build.BuildResult, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(_build.BuildError, match="--overlay-out: .* holds other files \\(keep.txt\\)"):
        _build.export_overlay(patched, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_overlay_outside_the_package_is_refused(tag: str, tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "evil.py").write_text("")
    with pytest.raises(_build.BuildError, match="'evil.py' is outside the sglang/ package"):
        _build.build(tmp_path / "dist", tag, overlay=overlay)


def test_hash_mismatch_is_refused(stock_wheel: Path, tag: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    data = bytearray(stock_wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (cache / stock_wheel.name).write_bytes(bytes(data))
    with pytest.raises(_build.BuildError, match=f"sha256 mismatch .* expected {_build.PINNED_SHA256[tag]}"):
        _build.build(tmp_path / "dist", tag, cache_dir=cache)
    assert not (tmp_path / "dist" / _build.patched_wheel_name(tag)).exists()


def test_patch_that_does_not_apply_is_refused(tag: str, tmp_path: Path) -> None:
    patch = tmp_path / "bad.patch"
    patch.write_text(_build.PATCH_FILE.read_text().replace(
        " from sglang.utils import convert_json_schema_to_str", " from sglang.utils import something_else"))
    with pytest.raises(_build.PatchError, match="protocol.py: hunk at patch line .* does not apply"):
        _build.build(tmp_path / "dist", tag, patch_file=patch)
    assert not list((tmp_path / "dist").glob("*.whl"))


@pytest.mark.parametrize("version", [(3, 10), (3, 13)])
def test_unsupported_interpreter_is_refused(version: tuple[int, int]) -> None:
    tag = f"cp{version[0]}{version[1]}"
    with pytest.raises(_build.BuildError, match=f"unsupported interpreter {tag}"):
        _build.python_tag(version)
    with pytest.raises(_build.BuildError, match=f"unsupported tag '{tag}'"):
        _build.build(Path("/nonexistent"), tag)


def test_cli_builds_and_exports_overlay(patched: _build.BuildResult, tag: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dist"
    out.mkdir()
    shutil.copy(patched.wheel, out / patched.wheel.name)
    code = _build.main(["--out", str(out), "--python-tag", tag, "--overlay-out", str(tmp_path / "ov")])
    assert code == 0
    assert "up to date, skipping" in capsys.readouterr().out
    assert (tmp_path / "ov" / "sglang" / "_version.py").is_file()
    assert _build.main(["--out", str(out), "--python-tag", "cp312" if tag == "cp311" else "cp311", "--install"]) == 2
    assert "--install: the wheel is for" in capsys.readouterr().err


def _tiny_wheel(folder: Path, body: str) -> Path:
    wheel = folder / "akvprobe-1.0-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    files = {"akvprobe.py": body,
             "akvprobe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: akvprobe\nVersion: 1.0\n",
             "akvprobe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             "akvprobe-1.0.dist-info/RECORD": ""}
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return wheel


def test_a_wheel_is_installed_once_per_machine_and_a_changed_wheel_gets_its_own_site(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "wheels"
    site = _build.installed_site(_tiny_wheel(tmp_path / "a", "X = 1\n"), cache)
    assert (site / "akvprobe.py").read_text() == "X = 1\n"
    (site / "akvprobe.py").unlink()  # a second install would bring it back
    assert _build.installed_site(_tiny_wheel(tmp_path / "a", "X = 1\n"), cache) == site
    assert not (site / "akvprobe.py").exists()
    other = _build.installed_site(_tiny_wheel(tmp_path / "b", "X = 2\n"), cache)
    assert other != site and (other / "akvprobe.py").read_text() == "X = 2\n"


def test_an_installed_site_carries_its_bytecode(tmp_path: Path) -> None:
    """Processes started with ``PYTHONDONTWRITEBYTECODE`` (CI's, this machine's) import the site without
    compiling its sources again: the cached bytecode is there and current."""
    site = _build.installed_site(_tiny_wheel(tmp_path / "a", "X = 1\n"), tmp_path / "cache" / "wheels")
    cached = Path(importlib.util.cache_from_source(str(site / "akvprobe.py")))
    assert cached.is_file()
    header, source = cached.read_bytes()[:16], (site / "akvprobe.py").stat()
    assert header[:4] == importlib.util.MAGIC_NUMBER and header[4:8] == bytes(4)  # checked by mtime and size
    assert int.from_bytes(header[8:12], "little") == int(source.st_mtime)
    assert int.from_bytes(header[12:16], "little") == source.st_size


def test_the_cached_build_is_reused_by_every_session(patched: _build.BuildResult, tag: str) -> None:
    again = _build.cached_build(tag)
    assert again.skipped and again.wheel == patched.wheel
