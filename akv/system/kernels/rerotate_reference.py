"""Plain PyTorch reference of ``rerotate_kv``: the same contract, one layer at a time."""

from __future__ import annotations

import torch

from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rope_spec import RopeSpec
from akv.system.reference.rope import rerotate
from akv.system.reference.yarn import rerotate as yarn_rerotate


def rerotate_kv_reference(
    k: LayerBuffers,
    v: LayerBuffers,
    src: torch.Tensor,
    dst: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """For every layer: ``k[dst] = R(new) R(old)^-1 k[src]`` in FP32 (original bits where
    ``old == new``), tail of K beyond ``rotary_dim`` and ``v[dst] = v[src]`` copied unchanged."""
    src, dst = src.long(), dst.long()
    same = (old_positions == new_positions)[:, None, None]
    for k_layer, v_layer in zip(k.layers, v.layers):
        rows = k_layer[src]
        if spec.yarn is None:
            rotated = rerotate(
                rows, old_positions, new_positions, theta=spec.theta, rotary_dim=spec.rotary_dim, neox=spec.neox
            ).to(rows.dtype)
        else:
            inv_freq = spec.yarn.inv_frequencies(spec.rotary_dim, spec.theta)
            rotated = yarn_rerotate(rows, old_positions, new_positions, inv_freq, neox=spec.neox).to(rows.dtype)
        k_layer[dst] = torch.where(same, rows, rotated)
        v_layer[dst] = v_layer[src]
