"""The SmolLM2 converter writes a model dir that the reference model computes exactly like transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from akv.system.models.__main__ import main as models_main
from akv.system.models.smollm2 import ConversionError, convert_smollm2, find_gguf

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        find_gguf()
    except ConversionError as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("smollm2") / "model"
    assert models_main(["smollm2", str(out), "--dtype", "float32"]) == 0
    return out


def test_directory_is_a_complete_llama_model(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / name).is_file(), name


def test_end_of_turn_is_eos_everywhere(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = json.loads((smollm2_dir / "config.json").read_text())
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token_id == config["eos_token_id"] == generation["eos_token_id"] == im_end


def test_template_matches_the_gguf_template_on_plain_chats(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf = find_gguf()
    original = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    converted = AutoTokenizer.from_pretrained(str(smollm2_dir))
    chats = [
        QUESTION,
        [{"role": "system", "content": "Be brief."}, *QUESTION,
         {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}],
    ]
    for chat in chats:
        for add in (False, True):
            expected = original.apply_chat_template(chat, tokenize=False, add_generation_prompt=add)
            assert converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=add) == expected


def test_template_renders_tool_calls_and_null_content(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tools = [{"type": "function", "function": {"name": "read_record", "parameters": {"type": "object"}}}]
    chat = [*QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_record", "arguments": '{"id": "A7"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "record A7"}]
    text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "read_record"' in text.split("<|im_start|>user")[0]
    assert '<tool_call>\n{"name": "read_record", "arguments": {"id": "A7"}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>tool\nrecord A7<|im_end|>\n<|im_start|>assistant\n")


def test_reference_model_equals_transformers_and_answers(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from akv.system.reference.model import ReferenceModel
    from akv.system.reference.oracle import run_oracle

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = rendered["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    reference = ReferenceModel.from_pretrained(smollm2_dir)
    ours = run_oracle(reference, ids).logits
    assert torch.allclose(ours, expected, atol=2e-3, rtol=1e-3), float((ours - expected).abs().max())

    generated = list(ids)
    for _ in range(8):
        generated.append(int(run_oracle(reference, generated).logits[-1].argmax()))
    assert "Paris" in tokenizer.decode(generated[len(ids):])


def test_refuses_a_non_empty_output_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        convert_smollm2(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        convert_smollm2(tmp_path / "new", dtype="int8")
