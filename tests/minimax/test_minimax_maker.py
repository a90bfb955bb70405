"""The MiniMax-M2 makers: transformers loads the tiny model as the real architecture with partial RoPE,
the dummy shape keeps the published attention and KV layout, lightning-attention models are refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from akv.system.kernels.rope_spec import RopeSpec
from akv.system.models import sdist_templates
from akv.system.models.__main__ import main
from akv.system.models.minimax_m2 import ADDED_TOKENS, UnsupportedMiniMaxError, check_supported

# Published MiniMax-M2 facts (official config.json): what must not change in a reduced shape.
PUBLISHED_ATTENTION = {
    "num_hidden_layers": 62, "hidden_size": 3072, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "rope_theta": 5e6, "qk_norm_type": "per_layer", "use_qk_norm": True,
    "rms_norm_eps": 1e-6, "vocab_size": 200064, "intermediate_size": 1536, "num_experts_per_tok": 8,
    "max_position_embeddings": 196608,
}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_transformers_loads_every_tensor_and_rotates_only_rotary_dim(minimax_dir: Path) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(minimax_dir, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "MiniMaxM2ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    stored = load_file(str(minimax_dir / "model.safetensors"))
    assert torch.equal(state["model.layers.1.mlp.e_score_correction_bias"],
                       stored["model.layers.1.block_sparse_moe.e_score_correction_bias"])
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(state[q_norm], stored[q_norm])
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 128,)  # one norm over all q heads
    # 32 frequencies = rotary_dim 64 of head_dim 128 (without partial_rotary_factor transformers has 64)
    assert model.model.rotary_emb.inv_freq.shape == (32,)


def test_config_names_rotary_dim_for_sglang_and_the_factor_for_transformers(minimax_dir: Path) -> None:
    config = _config(minimax_dir)
    assert config["rotary_dim"] == 64 and config["head_dim"] == 128
    assert config["partial_rotary_factor"] == config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert RopeSpec.from_config(config) == RopeSpec(theta=5e6, head_dim=128, rotary_dim=64, neox=True)
    assert RopeSpec.from_config(AutoConfig.from_pretrained(minimax_dir)).rotary_dim == 64
    official = {"rope_theta": 5e6, "head_dim": 128, "rotary_dim": 64}  # as published: no factor
    assert RopeSpec.from_config(official).rotary_dim == 64


def test_tokenizer_and_official_template(minimax_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(minimax_dir)
    assert tokenizer.bos_token == "]~!b[" and tokenizer.eos_token == "[e~["
    for content, special in ADDED_TOKENS:
        ids = tokenizer.encode("x" + content + "y", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(content) in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == ("xy" if special else "x" + content + "y")
    source = (minimax_dir / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(source).hexdigest() == sdist_templates.TEMPLATE_SHA256["MiniMax-M2.jinja"]
    hi = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True)
    assert text == "]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nHi[e~[\n]~b]ai\n<think>\n"
    vocab = json.loads((minimax_dir / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab


def test_dummy_shape_keeps_the_published_attention_and_kv(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    try:
        assert main(["minimax-m2-dummy", str(tmp_path / "d")]) == 0
    except sdist_templates.TemplateFetchError as exc:
        pytest.skip(f"official MiniMax-M2 template unavailable: {exc}")
    out = Path(capsys.readouterr().out.strip())
    config = _config(out)
    assert {k: config[k] for k in PUBLISHED_ATTENTION} == PUBLISHED_ATTENTION
    assert config["num_local_experts"] == 64 and config["attn_type_list"] == [1] * 62
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert not list(out.glob("*.safetensors"))
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("[e~[") == config["eos_token_id"]
    # KV per token: 62 layers x (K + V) x 8 heads x 128 x 2 bytes = 248 KiB
    kv_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    assert kv_bytes == 248 * 1024
    hf = {k: v for k, v in config.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 60.1
    attention = model.model.layers[0].self_attn
    assert (attention.q_proj.out_features, attention.k_proj.out_features) == (48 * 128, 8 * 128)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MiniMaxText01ForCausalLM"], "model_type": "minimax_text_01"}, "lightning attention"),
        ({"architectures": ["MiniMaxM1ForCausalLM"]}, "lightning attention"),
        ({"architectures": ["MiniMaxForCausalLM"], "model_type": "minimax"}, "lightning attention"),
        ({"attn_type_list": [1, 0]}, r"attn_type_list\[1\] = 0"),
        ({"layer_types": ["full_attention", "linear_attention"]}, r"layer_types\[1\] = 'linear_attention'"),
    ],
)
def test_older_lightning_attention_models_are_refused(minimax_dir: Path, change: dict, message: str) -> None:
    check_supported(_config(minimax_dir))
    with pytest.raises(UnsupportedMiniMaxError, match=message):
        check_supported({**_config(minimax_dir), **change})


def test_cached_template_is_checked(tmp_path: Path) -> None:
    bad = tmp_path / f"{sdist_templates.SDIST_NAME}-{sdist_templates.SDIST_VERSION}" / "MiniMax-M2.jinja"
    bad.parent.mkdir(parents=True)
    bad.write_text("{{ messages }}")
    with pytest.raises(sdist_templates.TemplateFetchError, match="sha256 differs"):
        sdist_templates.official_template("MiniMax-M2.jinja", cache=tmp_path)
    with pytest.raises(ValueError, match="name must be one of"):
        sdist_templates.official_template("Nope.jinja", cache=tmp_path)


def test_seed_changes_only_the_weights_and_bfloat16_keeps_the_routing_bias_fp32(tmp_path: Path) -> None:
    from akv.system.models.minimax_m2 import make_minimax_m2_tiny

    try:
        a = make_minimax_m2_tiny(tmp_path / "a", seed=1)
    except sdist_templates.TemplateFetchError as exc:
        pytest.skip(f"official MiniMax-M2 template unavailable: {exc}")
    b = make_minimax_m2_tiny(tmp_path / "b", seed=2, dtype="bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert _config(a) == {**_config(b), "torch_dtype": "float32"}
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert wb["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert wb["model.layers.0.block_sparse_moe.e_score_correction_bias"].dtype == torch.float32
    assert not torch.equal(wa["lm_head.weight"], wb["lm_head.weight"].float())


def test_cli_names_a_bad_expert_count(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["minimax-m2-dummy", str(tmp_path / "d"), "--experts", "4"]) == 2
    assert "num_experts_per_tok (8) exceeds num_local_experts (4)" in capsys.readouterr().err
