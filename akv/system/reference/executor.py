"""Run a cache core :class:`RequestPlan` with the reference model: copy/re-rotate jobs, then each
segment through :func:`forward_paged`, then generation over the terminal view. A CPU stand-in for
what the SGLang integration does on the GPU, used to prove plans against the oracle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from akv.system.cache.plan import CopyJob, RequestPlan, Segment
from akv.system.context.program import ContextProgram
from akv.system.reference.model import ReferenceModel
from akv.system.reference.paged import forward_paged


@dataclass(frozen=True)
class PagedKV:
    """Per-layer K (stored rotated) and V pools, ``[n_slots, kv_heads, head_dim]`` on the model's device;
    slot 0 is padding. ``positions[slot]`` (on the CPU) is the position the slot's K is rotated at (-1
    before any write)."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    positions: torch.Tensor

    @classmethod
    def empty(cls, model: ReferenceModel, n_slots: int, dtype: torch.dtype = torch.float32) -> PagedKV:
        c, device = model.config, model.device
        shape = (n_slots, c.num_kv_heads, c.head_dim)
        return cls(tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)),
                   tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)),
                   torch.full((n_slots,), -1, dtype=torch.int64))


def run_copies(model: ReferenceModel, kv: PagedKV, job: CopyJob) -> None:
    """Every layer: ``k[dst] = R(new) R(old)^-1 k[src]`` in FP32 (the model's RoPE), ``v[dst] = v[src]``."""
    if job.size == 0:
        return
    device = model.device
    src, dst = torch.from_numpy(job.src.copy()).to(device), torch.from_numpy(job.dst.copy()).to(device)
    old, new = torch.from_numpy(job.old_positions.copy()), torch.from_numpy(job.new_positions.copy())
    old_d, new_d = old.to(device), new.to(device)
    for k, v in zip(kv.k, kv.v):
        k[dst] = model.rerotate_keys(k[src], old_d, new_d).to(k.dtype)
        v[dst] = v[src]
    kv.positions[torch.from_numpy(job.dst.copy())] = new


def run_prefill(model: ReferenceModel, program: ContextProgram, plan: RequestPlan, kv: PagedKV,
                max_chunk: int | None = None) -> dict[int, torch.Tensor]:
    """Execute the plan's segments (split into forwards of at most ``max_chunk`` queries, if given)
    and terminal copies; return the logits of every computed query.

    The program's last token, whose logits start generation, always runs in a forward of its own: a
    matrix product's rounding depends on how many rows it has, and this way a request repeated over
    its own cached prompt (which recomputes only that token) gets bitwise the same logits as cold."""
    logits: dict[int, torch.Tensor] = {}
    parts = [p for s in plan.segments for p in _last_token_alone(s, program.n_tokens)]
    forwards = [c for p in parts for c in (p.chunks(max_chunk) if max_chunk else (p,))]
    for segment in forwards:
        run_copies(model, kv, segment.copies)
        indptr, indices = segment.visible_slots()
        out = forward_paged(
            model,
            torch.from_numpy(program.token_ids[segment.start : segment.end].copy()),
            torch.from_numpy(segment.positions.copy()),
            kv.k,
            kv.v,
            torch.from_numpy(segment.slots.copy()),
            torch.from_numpy(indptr),
            torch.from_numpy(indices),
            slot_positions=kv.positions,
        )
        logits.update({segment.start + i: out[i] for i in range(segment.n_queries)})
    run_copies(model, kv, plan.terminal.copies)
    return logits


def _last_token_alone(segment: Segment, n_tokens: int) -> tuple[Segment, ...]:
    if segment.end == n_tokens and segment.n_queries > 1:
        return segment.chunks(segment.n_queries - 1)
    return (segment,)


def run_decode(model: ReferenceModel, plan: RequestPlan, kv: PagedKV, token_ids: np.ndarray, slots: np.ndarray) -> torch.Tensor:
    """Feed ``token_ids`` one at a time after the prompt (teacher forcing), writing their KV to
    ``slots``; each reads the terminal view plus the tokens fed before it. Returns ``[n, vocab]``."""
    token_ids, slots = np.asarray(token_ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    if token_ids.shape != slots.shape or token_ids.ndim != 1:
        raise ValueError(f"slots: shape {slots.shape} does not match token_ids {token_ids.shape}")
    terminal = plan.terminal
    rows = []
    for j in range(token_ids.size):
        visible = np.concatenate([terminal.slots, slots[: j + 1]])
        rows.append(forward_paged(
            model,
            torch.tensor([token_ids[j]]),
            torch.tensor([terminal.next_position + j]),
            kv.k,
            kv.v,
            torch.tensor([slots[j]]),
            torch.tensor([0, visible.size]),
            torch.from_numpy(visible),
            slot_positions=kv.positions,
        )[0])
    return torch.stack(rows) if rows else torch.zeros(0, model.config.vocab_size, device=model.device)
