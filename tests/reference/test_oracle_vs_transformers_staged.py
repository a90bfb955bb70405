"""The oracle under events equals transformers driven by hand: one forward per stage over its KV cache,
dropped tokens masked out with a 4-D additive mask, and cached keys re-rotated in place at each Repos."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, OracleEvent, Repos, run_oracle
from akv.system.reference.rope import rerotate

EVENTS: list[OracleEvent] = [
    Drop(9, (2, 3, 4)), Repos(9), Drop(17, (11, 12)), Drop(24, (0, 20, 21)), Repos(24), Repos(30),
]
N_TOKENS = 36


def transformers_staged(model_dir: Path, ids: torch.Tensor, events: list[OracleEvent], theta: float) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    cache = DynamicCache(config=hf.config)
    position: dict[int, int] = {}  # visible token -> current position
    next_position, done, logits = 0, 0, []
    for end in sorted({e.at for e in events} | {len(ids)}):
        if end > done:
            m = end - done
            allowed = torch.zeros(m, end, dtype=torch.bool)
            allowed[:, sorted(position)] = True
            allowed[:, done:] = torch.ones(m, m, dtype=torch.bool).tril()
            mask = torch.zeros(1, 1, m, end).masked_fill(~allowed, float("-inf"))
            positions = torch.arange(next_position, next_position + m)
            with torch.no_grad():
                out = hf(ids[None, done:end], attention_mask=mask, position_ids=positions[None],
                         past_key_values=cache, use_cache=True)
            logits.append(out.logits[0])
            position.update({done + j: int(p) for j, p in enumerate(positions)})
            next_position, done = next_position + m, end
        for event in (e for e in events if e.at == end):
            if isinstance(event, Drop):
                for t in event.tokens:
                    position.pop(t, None)
                continue
            tokens = sorted(position)
            old, new = torch.tensor([position[t] for t in tokens]), torch.arange(len(tokens))
            for layer in cache.layers:  # keys: [1, kv_heads, tokens, head_dim]
                keys = layer.keys[0, :, tokens].transpose(0, 1)
                layer.keys[0, :, tokens] = rerotate(keys, old, new, theta=theta).transpose(0, 1)
            position = dict(zip(tokens, new.tolist()))
            next_position = len(tokens)
    return torch.cat(logits)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama"])
def test_oracle_equals_transformers_with_masks_and_rerotated_cache(tiny_dirs: dict[str, Path], name: str) -> None:
    ids = torch.randint(0, 512, (N_TOKENS,), generator=torch.Generator().manual_seed(12))
    model = ReferenceModel.from_pretrained(tiny_dirs[name])
    expected = transformers_staged(tiny_dirs[name], ids, EVENTS, model.config.rope_theta)
    result = run_oracle(model, ids, EVENTS)
    torch.testing.assert_close(result.log_probs(), torch.log_softmax(expected, dim=-1), atol=1e-4, rtol=0)
    unchanged = run_oracle(model, ids)
    assert (unchanged.logits[9:] - result.logits[9:]).abs().max() > 1e-2, "the events must matter"
