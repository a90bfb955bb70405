"""The reference model and engine on another torch device: CUDA FP32 gives the CPU's logits (GPU
only), and prompts run in chunks give the unchunked engine's replies (CPU)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, Repos, run_oracle
from akv.system.reference_server import Engine, ReferenceServer

from .test_exactness import CONVERSATION, TOOLS

BODIES = [
    {"messages": CONVERSATION[:4]},
    {"messages": CONVERSATION, "drop_message": {"5": [3], "7": [5]}, "reposition": [5, 7]},
]


def _serve(engine: Engine) -> list[dict[str, Any]]:
    replies = []
    with ReferenceServer(engine).running() as server:
        for body in BODIES:
            full = {"model": engine.model_name, "tools": TOOLS, "max_tokens": 8, "temperature": 0.0,
                    "logprobs": True, "top_logprobs": 5, **body}
            request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(full).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                replies.append(json.loads(response.read()))
    return replies


def _assert_same_replies(got: list[dict[str, Any]], want: list[dict[str, Any]], tolerance: float) -> None:
    for a, b in zip(got, want, strict=True):
        steps_a, steps_b = a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]
        assert [s["token"] for s in steps_a] == [s["token"] for s in steps_b]
        for x, y in zip(steps_a, steps_b, strict=True):
            assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
            assert max(abs(s["logprob"] - t["logprob"]) for s, t in
                       zip(x["top_logprobs"], y["top_logprobs"], strict=True)) <= tolerance
        assert a["usage"] == b["usage"]


def test_chunked_prefill_serves_the_unchunked_replies(tiny_model_dir: Path) -> None:
    whole = _serve(Engine(tiny_model_dir, name="tiny", kv_slots=4096))
    chunked = _serve(Engine(tiny_model_dir, name="tiny", kv_slots=4096, prefill_chunk=7))
    assert whole[1]["usage"]["prompt_tokens_details"]["drop_skipped_tokens"] > 0
    _assert_same_replies(chunked, whole, 1e-5)


def test_prefill_chunk_must_be_positive(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
        Engine(tiny_model_dir, kv_slots=64, prefill_chunk=0)


@pytest.mark.gpu
def test_cuda_fp32_logits_equal_the_cpu_ones(tiny_model_dir: Path) -> None:
    assert not torch.backends.cuda.matmul.allow_tf32, "FP32 matmuls must not run in TF32 for the oracle"
    cpu = ReferenceModel.from_pretrained(tiny_model_dir)
    cuda = ReferenceModel.from_pretrained(tiny_model_dir, device="cuda")
    assert all(w.device.type == "cuda" for w in cuda._w.values())
    ids = torch.randint(0, cpu.config.vocab_size, (96,), generator=torch.Generator().manual_seed(0))
    events = [Drop(at=40, tokens=tuple(range(10, 30))), Repos(at=40), Drop(at=70, tokens=tuple(range(45, 60)))]
    want, got = run_oracle(cpu, ids, events), run_oracle(cuda, ids, events)
    assert got.logits.device.type == "cuda"
    torch.testing.assert_close(got.logits.cpu(), want.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_the_engine_on_cuda_serves_the_cpu_replies(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, name="tiny", kv_slots=4096, device="cuda")
    assert engine.kv.k[0].device.type == "cuda" and engine.kv.v[-1].device.type == "cuda"
    _assert_same_replies(_serve(engine), _serve(Engine(tiny_model_dir, name="tiny", kv_slots=4096)), 1e-5)
