"""The server-shaped forward step: new tokens read a slot-addressed KV pool through per-query slot lists."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from akv.system.reference.model import ReferenceModel


def forward_paged(
    model: ReferenceModel,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    k_pool: Sequence[torch.Tensor],
    v_pool: Sequence[torch.Tensor],
    out_slots: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    slot_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append ``token_ids[n]`` at ``positions[n]`` and return their logits ``[n, vocab]`` (float32).

    ``k_pool[layer]`` / ``v_pool[layer]`` are ``[slots, kv_heads, head_dim]``; K is stored already
    rotated. Per layer, each new token's K (rotated at its position) and V are written, in place, to
    ``out_slots[i]``, then query ``i`` attends to exactly the slots
    ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (its own slot and earlier new tokens' slots included
    for causal attention; dropped keys are simply not listed).

    ``slot_positions`` (int64 ``[slots]`` on the CPU, updated in place at ``out_slots``) holds the position each
    slot's K is rotated at; models with sliding-window layers need it to know how far back a key is.

    The pools live on the model's device; the index arguments may live anywhere (they are checked on
    the CPU and moved to the model's device for the forward); the logits come back on the model's device.

    Keys enter attention in the order they are first listed, never in slot order, so the result does not
    depend on which slots the pool handed out."""
    c = model.config
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
    n = int(ids.numel())
    positions = torch.as_tensor(positions, dtype=torch.int64).cpu()
    out_slots = torch.as_tensor(out_slots, dtype=torch.int64).cpu()
    kv_indptr = torch.as_tensor(kv_indptr, dtype=torch.int64).cpu()
    kv_indices = torch.as_tensor(kv_indices, dtype=torch.int64).cpu()
    n_slots = _check_pools(model, k_pool, v_pool)
    _check_vector("positions", positions, n)
    _check_vector("out_slots", out_slots, n)
    if n and (int(positions.min()) < 0):
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    _check_slots("out_slots", out_slots, n_slots)
    if out_slots.unique().numel() != n:
        raise ValueError(f"out_slots must be distinct, got {out_slots.tolist()}")
    rows = _check_csr(kv_indptr, kv_indices, n, n_slots)
    if slot_positions is not None:
        _check_vector("slot_positions", slot_positions, n_slots)
        if slot_positions.device.type != "cpu":
            raise ValueError(f"slot_positions must be a CPU tensor (index bookkeeping), got {slot_positions.device}")
        slot_positions[out_slots] = positions

    slots, columns = _in_listed_order(kv_indices)
    key_positions = slot_positions[slots] if slot_positions is not None else torch.full_like(slots, -1)
    visible = torch.zeros(n, slots.numel(), dtype=torch.bool)
    visible[rows, columns] = True
    device = model.device
    positions, out_slots, slots = positions.to(device), out_slots.to(device), slots.to(device)
    visible, key_positions = visible.to(device), key_positions.to(device)
    with torch.no_grad():
        hidden = model.embed(ids)
        for layer in range(c.num_layers):
            inputs = model.attention_inputs(layer, hidden)
            k_pool[layer][out_slots] = model.rotate(inputs.k, positions).to(k_pool[layer].dtype)
            v_pool[layer][out_slots] = inputs.v.to(v_pool[layer].dtype)
            keys = k_pool[layer][slots].to(model.dtype)
            values = v_pool[layer][slots].to(model.dtype)
            attention = model.attend_layer(layer, model.rotate(inputs.q, positions), keys, values, visible,
                                           positions, key_positions)
            hidden = model.finish_layer(layer, hidden, attention)
        return model.logits(hidden).to(torch.float32)


def _in_listed_order(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct slots of ``indices`` in the order each is first listed, and every entry's column among them."""
    ascending, inverse = torch.unique(indices, return_inverse=True)
    first = torch.full_like(ascending, indices.numel()).scatter_reduce(
        0, inverse, torch.arange(indices.numel()), reduce="amin")
    order = torch.argsort(first)
    column = torch.empty_like(order)
    column[order] = torch.arange(order.numel())
    return ascending[order], column[inverse]


def _check_pools(model: ReferenceModel, k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor]) -> int:
    c = model.config
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if len(pool) != c.num_layers:
            raise ValueError(f"{name} must hold one tensor per layer ({c.num_layers}), got {len(pool)}")
    n_slots = int(k_pool[0].shape[0])
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        for layer, tensor in enumerate(pool):
            if tuple(tensor.shape) != (n_slots, c.num_kv_heads, c.head_dim):
                raise ValueError(f"{name}[{layer}] must have shape {(n_slots, c.num_kv_heads, c.head_dim)}, "
                                 f"got {tuple(tensor.shape)}")
    return n_slots


def _check_vector(name: str, tensor: torch.Tensor, n: int) -> None:
    if tuple(tensor.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(tensor.shape)}")


def _check_slots(name: str, slots: torch.Tensor, n_slots: int) -> None:
    bad = slots[(slots < 0) | (slots >= n_slots)]
    if bad.numel():
        raise ValueError(f"{name} must be slots in [0, {n_slots}), got {int(bad[0])}")


def _check_csr(indptr: torch.Tensor, indices: torch.Tensor, n: int, n_slots: int) -> torch.Tensor:
    """Validate the per-query slot lists; return the query row of every entry of ``indices``."""
    _check_vector("kv_indptr", indptr, n + 1)
    if indices.ndim != 1:
        raise ValueError(f"kv_indices must be 1-D, got shape {tuple(indices.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != indices.numel():
        raise ValueError(f"kv_indptr must start at 0 and end at len(kv_indices)={indices.numel()}, "
                         f"got {int(indptr[0])}..{int(indptr[-1])}")
    counts = indptr[1:] - indptr[:-1]
    if bool((counts <= 0).any()):
        query = int((counts <= 0).nonzero()[0])
        raise ValueError(f"kv_indptr must give every query at least one slot, query {query} has {int(counts[query])}")
    _check_slots("kv_indices", indices, n_slots)
    rows = torch.repeat_interleave(torch.arange(n), counts)
    if torch.unique(rows * n_slots + indices).numel() != indices.numel():
        raise ValueError("kv_indices must not list a slot twice for one query")
    return rows
