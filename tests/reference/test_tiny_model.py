"""The tiny model maker writes directories that transformers and tokenizers load as the real thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from akv.system.models.tiny import ADDED_TOKENS, ARCHITECTURES, make_tiny_model


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama"])
def test_transformers_loads_every_tensor(tiny_dirs: dict[str, Path], name: str) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == ARCHITECTURES[name]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = load_file(str(tiny_dirs[name] / "model.safetensors"))
    for tensor_name, tensor in stored.items():
        assert torch.equal(model.state_dict()[tensor_name], tensor), tensor_name


@pytest.mark.parametrize("vocab_size", [512, 3000])
def test_tokenizer_size_equals_config_vocab(tmp_path: Path, vocab_size: int) -> None:
    out = make_tiny_model(tmp_path, vocab_size=vocab_size, weights=False)
    config = json.loads((out / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert config["vocab_size"] == vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert sorted(tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))
    assert not (out / "model.safetensors").exists()
    text = "Cache 😀 tree: {\"city\": \"Zürich\"}\n    def f(x):\n        return None"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_added_tokens_are_single_ids_at_the_end(qwen3_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    vocab_size = json.loads((qwen3_dir / "config.json").read_text())["vocab_size"]
    expected_ids = list(range(vocab_size - len(ADDED_TOKENS), vocab_size))
    assert [tokenizer.convert_tokens_to_ids(content) for content, _ in ADDED_TOKENS] == expected_ids
    for content, special in ADDED_TOKENS:
        ids = tokenizer.encode("x" + content + "y", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(content) in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == ("xy" if special else "x" + content + "y")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_offsets_are_character_offsets_covering_the_text(qwen3_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    text = "<|im_start|>user\nnaïve 漢字 😀 test<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call>"
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = encoded["offset_mapping"]
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (start, end), (next_start, _) in zip(offsets, offsets[1:]):
        assert start < end and start <= next_start <= end
    covered = set()
    for start, end in offsets:
        covered.update(range(start, end))
    assert covered == set(range(len(text)))
    for token_id, (start, end) in zip(encoded["input_ids"], offsets):
        if tokenizer.convert_ids_to_tokens(token_id) in {c for c, _ in ADDED_TOKENS}:
            assert text[start:end] == tokenizer.convert_ids_to_tokens(token_id)


def test_chat_template_renders_tools_calls_and_merged_results(qwen3_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
            {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}},
        ]},
        {"role": "tool", "content": "cold"},
        {"role": "tool", "content": "warm"},
        {"role": "assistant", "content": "Cold, warm."},
        {"role": "user", "content": ""},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions. Their signatures are "
        "inside <tools></tools>:\n<tools>\n" + json.dumps(tool) + "\n</tools>\n\nReturn each call as a JSON object "
        "{\"name\": ..., \"arguments\": ...} inside <tool_call></tool_call> tags.<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
        "\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\ncold\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nCold, warm.<|im_end|>\n"
        "<|im_start|>user\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered == expected
    plain = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nWeather in Oslo and Rome?<|im_end|>\n"


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", seed=3)
    second = make_tiny_model(tmp_path / "b", seed=3)
    third = make_tiny_model(tmp_path / "c", seed=4)
    for file in sorted(p.name for p in first.iterdir()):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
    assert (first / "tokenizer.json").read_bytes() == (third / "tokenizer.json").read_bytes()
    weights_a, weights_c = load_file(str(first / "model.safetensors")), load_file(str(third / "model.safetensors"))
    assert not torch.equal(weights_a["model.embed_tokens.weight"], weights_c["model.embed_tokens.weight"])


def test_bfloat16_weights_and_config(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch must be one of"),
        ({"vocab_size": 100}, "vocab_size must be at least 265"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive int, got True"),
        ({"arch": "qwen2", "head_dim": 32}, "head_dim must equal hidden_size // num_attention_heads"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"dtype": "float16"}, "dtype must be"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_sharded_weights_load_in_transformers_and_repeat_per_seed(tmp_path: Path) -> None:
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "vocab_size": 600,
             "tie_word_embeddings": False}
    lines: list[str] = []
    out = make_tiny_model(tmp_path / "a", seed=5, dtype="bfloat16", shard_bytes=100_000, log=lines.append, **shape)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) == len(lines) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    stored = {k: v for p in shards for k, v in load_file(str(p)).items()}
    assert set(stored) == set(index["weight_map"]) == set(model.state_dict())
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert abs(float(stored["model.norm.weight"].float().mean()) - 1.0) < 0.05
    assert abs(float(stored["lm_head.weight"].float().std()) - 2 * 128**-0.5) < 0.01
    again = make_tiny_model(tmp_path / "b", seed=5, dtype="bfloat16", shard_bytes=100_000, **shape)
    other = make_tiny_model(tmp_path / "c", seed=6, dtype="bfloat16", shard_bytes=100_000, **shape)
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in shards)
    assert (other / shards[0].name).read_bytes() != shards[0].read_bytes()
