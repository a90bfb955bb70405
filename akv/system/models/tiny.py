"""Write small random-weight HF-style model directories (Qwen3, Qwen2, Llama layouts) for tests.

Nothing is downloaded: the byte-level BPE tokenizer is trained in memory on a fixed synthetic corpus,
so the tokenizer depends only on ``vocab_size``; ``seed`` only changes the weights.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Arch = Literal["qwen3", "qwen2", "llama"]

ARCHITECTURES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}

# (content, special). Special tokens are skipped by decode(skip_special_tokens=True); the tool and
# think markers stay visible to parsers, as in the Qwen tokenizers.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

BYTE_ALPHABET_SIZE = 256

CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}{{- (messages[0].content or '') + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions. Their signatures are inside <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nReturn each call as a JSON object {"name": ..., "arguments": ...} inside <tool_call></tool_call> tags.<|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + (messages[0].content or '') + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- '<|im_start|>system\n' + (message.content or '') + '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + (message.content or '') + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in (message.tool_calls or []) %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- raise_exception('unknown message role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or have an they which one you "
    "were all there would their we has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any now such like over even most "
    "made after also did many before must through back where much your way well down should because each "
    "just those people how little good very make world still see work long get here between both under "
    "never day same another know while last might great old year off come since against right used take "
    "cache memory agent token model server request reply page block prefix tree keep note summary context "
    "window tool call function arguments result error value weather city search file read write query "
    "answer question think plan step check test user assistant system message content role name"
).split()
_CODE = "def class return import self None True False if else for while try except with as yield raise".split()
_SYLLABLES = "ka ri to mu ne sa lo vi pe du ga zo chi ba fu ha me ki no ta".split()
_UNICODE = "é ü ß ø ñ 漢 字 日 本 语 😀 🚀 → ∑ λ".split()


@dataclass(frozen=True)
class TinyShape:
    """Model dimensions written to config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: Arch = "qwen3",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 32768,
    dtype: Literal["float32", "bfloat16"] = "float32",
    weights: bool = True,
    shard_bytes: int | None = None,
    device: str = "cpu",
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
    special_tokens_map.json and (with ``weights``) model.safetensors into ``out_dir``; return it.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (Qwen2 requires exactly that).
    The tokenizer has exactly ``vocab_size`` entries, so every id the model can emit decodes.

    With ``shard_bytes``, the weights are drawn tensor by tensor on ``device`` (one generator per
    tensor, seeded from ``seed``: the same seed and device type give the same bytes; the draws differ
    from the single-file ones) and written as shards of about ``shard_bytes`` with a
    ``model.safetensors.index.json``, ``log`` told of each shard: what a full-size model needs."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    shape = _checked_shape(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads if head_dim is None else head_dim,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(shape.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {content: tokenizer.token_to_id(content) for content, _ in ADDED_TOKENS}
    config = _model_config(arch, shape, ids, tie_word_embeddings, rope_theta, max_position_embeddings, dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(ids))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids, max_position_embeddings))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    if weights and shard_bytes is not None:
        write_sharded_weights(out, arch, shape, tie_word_embeddings, seed, dtype, shard_bytes, device, log)
    elif weights:
        _write_weights(out / "model.safetensors", arch, shape, tie_word_embeddings, seed, dtype)
    return out


def _checked_shape(arch: str, **dims: int) -> TinyShape:
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    shape = TinyShape(**dims)
    minimum_vocab = BYTE_ALPHABET_SIZE + len(ADDED_TOKENS)
    if shape.vocab_size < minimum_vocab:
        raise ValueError(f"vocab_size must be at least {minimum_vocab} (byte alphabet + added tokens), "
                         f"got {shape.vocab_size}")
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({shape.num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({shape.num_key_value_heads})")
    if shape.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {shape.head_dim}")
    if arch == "qwen2" and shape.head_dim * shape.num_attention_heads != shape.hidden_size:
        raise ValueError(f"head_dim must equal hidden_size // num_attention_heads for qwen2, got {shape.head_dim}")
    return shape


def synthetic_corpus(n_lines: int = 1500) -> list[str]:
    """Fixed mixed prose / code / JSON / unicode lines the tokenizer is trained on."""
    rng = random.Random(20261129)
    coined = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(600)})
    words = _WORDS + coined
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 6
        if kind < 3:
            text = " ".join(rng.choices(words, k=rng.randint(5, 16)))
            lines.append(text.capitalize() + rng.choice(".?!,:"))
        elif kind == 3:
            name, args = rng.choice(words), ", ".join(rng.sample(_CODE + words[:100], 3))
            lines.append(f"    def {name}_{rng.randint(0, 99)}({args}):\n        return {rng.choice(_CODE)}")
        elif kind == 4:
            call = {"name": f"{rng.choice(words)}_{rng.choice(words)}",
                    "arguments": {rng.choice(words): rng.choice([rng.choice(words), rng.randint(0, 9999)])}}
            lines.append("<tool_call>\n" + json.dumps(call) + "\n</tool_call>")
        else:
            lines.append(" ".join(rng.choices(_UNICODE + words[:50], k=rng.randint(3, 8))))
    return lines


def build_tokenizer(vocab_size: int, added_tokens: tuple[tuple[str, bool], ...] = ADDED_TOKENS) -> Any:
    """Byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries, ``added_tokens``
    (content, special) last."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe_size = vocab_size - len(added_tokens)
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(synthetic_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() < bpe_size:
        tokenizer = _padded_with_merges(tokenizer, bpe_size)
    for content, special in added_tokens:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def _padded_with_merges(tokenizer: Any, bpe_size: int) -> Any:
    """Append deterministic merges of existing tokens until the BPE vocab has ``bpe_size`` entries."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    pieces = sorted(vocab, key=vocab.__getitem__)
    left = 0
    while len(vocab) < bpe_size:
        for right in pieces[BYTE_ALPHABET_SIZE:] + pieces[:BYTE_ALPHABET_SIZE]:
            if len(vocab) == bpe_size:
                break
            merged = pieces[left] + right
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append([pieces[left], right])
        left += 1
    return Tokenizer.from_str(json.dumps(data))


def _model_config(
    arch: str,
    shape: TinyShape,
    ids: dict[str, int],
    tie_word_embeddings: bool,
    rope_theta: float,
    max_position_embeddings: int,
    dtype: str,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": dtype,
    }
    if arch in ("qwen3", "llama"):
        config["head_dim"] = shape.head_dim
        config["attention_bias"] = False
    if arch in ("qwen3", "qwen2"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_hidden_layers)
    if arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    return config


def _generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }


def _tokenizer_config(ids: dict[str, int], max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "special": special, "normalized": False,
                                "lstrip": False, "rstrip": False, "single_word": False}
            for content, special in ADDED_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_weights(path: Path, arch: str, shape: TinyShape, tied: bool, seed: int, dtype: str) -> None:
    """Every tensor of :func:`weight_specs` drawn in file order from one generator seeded ``seed``:
    scaled so attention and logits are far from uniform."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    target = torch.float32 if dtype == "float32" else torch.bfloat16
    tensors = {name: _scaled(torch.randn(dims, generator=gen), kind).to(target).contiguous()
               for name, dims, kind in weight_specs(arch, shape, tied)}
    save_file(tensors, str(path), metadata={"format": "pt"})


def weight_specs(arch: str, shape: TinyShape, tied: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF tensor name, shape, distribution) of every weight, in file order; distributions (drawn by
    :func:`_scaled`): ``matrix`` N(0, 1/fan_in), ``embedding`` N(0, 0.25^2), ``norm``
    1 + N(0, 0.1^2), ``bias`` N(0, 0.1^2), ``head`` N(0, 4/fan_in)."""
    hidden, inter, head = shape.hidden_size, shape.intermediate_size, shape.head_dim
    n_q, n_kv = shape.num_attention_heads * head, shape.num_key_value_heads * head
    specs = [("model.embed_tokens.weight", (shape.vocab_size, hidden), "embedding")]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs += [(p + "input_layernorm.weight", (hidden,), "norm"),
                  (p + "self_attn.q_proj.weight", (n_q, hidden), "matrix"),
                  (p + "self_attn.k_proj.weight", (n_kv, hidden), "matrix"),
                  (p + "self_attn.v_proj.weight", (n_kv, hidden), "matrix")]
        if arch == "qwen2":
            specs += [(p + f"self_attn.{x}_proj.bias", (n,), "bias") for x, n in (("q", n_q), ("k", n_kv), ("v", n_kv))]
        if arch == "qwen3":
            specs += [(p + "self_attn.q_norm.weight", (head,), "norm"),
                      (p + "self_attn.k_norm.weight", (head,), "norm")]
        specs += [(p + "self_attn.o_proj.weight", (hidden, n_q), "matrix"),
                  (p + "post_attention_layernorm.weight", (hidden,), "norm"),
                  (p + "mlp.gate_proj.weight", (inter, hidden), "matrix"),
                  (p + "mlp.up_proj.weight", (inter, hidden), "matrix"),
                  (p + "mlp.down_proj.weight", (hidden, inter), "matrix")]
    specs.append(("model.norm.weight", (hidden,), "norm"))
    if not tied:
        specs.append(("lm_head.weight", (shape.vocab_size, hidden), "head"))
    return specs


def write_sharded_weights(out: Path, arch: str, shape: TinyShape, tied: bool, seed: int, dtype: str, shard_bytes: int,
                          device: str = "cpu", log: Callable[[str], None] | None = None) -> list[Path]:
    """``model-0000k-of-0000n.safetensors`` shards of about ``shard_bytes`` each and their index, the
    tensors drawn one at a time on ``device`` (see :func:`make_tiny_model`); returns the shard paths."""
    import torch
    from safetensors.torch import save_file

    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    target = torch.float32 if dtype == "float32" else torch.bfloat16
    width = torch.tensor([], dtype=target).element_size()
    specs = weight_specs(arch, shape, tied)
    groups: list[list[int]] = [[]]
    size = 0
    for index, (_, dims, _) in enumerate(specs):
        n_bytes = width * int(torch.Size(dims).numel())
        if groups[-1] and size + n_bytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += n_bytes
    weight_map: dict[str, str] = {}
    paths = []
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {specs[i][0]: _draw(specs[i][1], specs[i][2], seed * 1_000_003 + i, device).to(target).cpu()
                   for i in group}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        paths.append(out / name)
        if log is not None:
            log(f"{out.name}: wrote {name} ({sum(t.numel() for t in tensors.values()) * width / 2**30:.2f} GiB)")
    total = sum(width * int(torch.Size(dims).numel()) for _, dims, _ in specs)
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return paths


def _draw(dims: tuple[int, ...], kind: str, seed: int, device: str) -> Any:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return _scaled(torch.randn(dims, generator=gen, device=device), kind)


def _scaled(x: Any, kind: str) -> Any:
    """Standard normal draws ``x`` scaled to a :func:`weight_specs` distribution."""
    if kind == "matrix":
        return x / x.shape[-1] ** 0.5
    if kind == "head":
        return 2.0 * (x / x.shape[-1] ** 0.5)
    if kind == "norm":
        return 1.0 + 0.1 * x
    return {"embedding": 0.25, "bias": 0.1}[kind] * x
