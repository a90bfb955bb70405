"""Triton RoPE re-rotation of KV slots across all layers of a pool in one launch.

A copy ``(src, dst, old, new)`` reads K of slot ``src`` at every layer, undoes the rotation to
``old`` and applies the rotation to ``new`` (FP32, two rotations, no angle-difference shortcut),
and writes the result to slot ``dst``. When ``src != dst`` the non-rotary tail of K and all of V
are copied too. When ``old == new`` the original bits are written (nothing at all when in place).

cos/sin come from a ``RopeTable``: the reference angles, or SGLang's own ``cos_sin_cache`` so that a
re-rotated key equals the key the model computes at the new position. The result is rounded once
to the buffer dtype, so a key re-rotated k times carries k roundings (bf16: ~2^-9 relative each);
rotating from the original copy where one exists avoids the accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from akv.system.kernels.launch_device import check_launchable
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rope_spec import RopeTable

_TARGET_PROGRAMS = 2048
_TILE_ELEMENTS = 4096


@dataclass(frozen=True)
class RerotateLaunch:
    """Launch shape: copies per program, layers per program, warps per program."""

    block_copies: int
    layers_per_program: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for field in ("block_copies", "num_warps"):
            value = getattr(self, field)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"RerotateLaunch.{field} must be a positive power of two, got {value}")
        if self.layers_per_program <= 0:
            raise ValueError(f"RerotateLaunch.layers_per_program must be > 0, got {self.layers_per_program}")

    @classmethod
    def default(cls, n_copies: int, k: LayerBuffers) -> RerotateLaunch:
        """About ``_TILE_ELEMENTS`` rotary elements per program and enough programs to fill the GPU."""
        half = triton.next_power_of_2(k.head_dim) // 2
        block = max(1, _TILE_ELEMENTS // (triton.next_power_of_2(k.heads) * half))
        copy_blocks = triton.cdiv(max(n_copies, 1), block)
        layers = max(1, min(k.n_layers, copy_blocks * k.n_layers // _TARGET_PROGRAMS))
        groups = triton.cdiv(k.n_layers, layers)
        return cls(block_copies=block, layers_per_program=triton.cdiv(k.n_layers, groups))


@triton.jit
def _rerotate_kernel(
    k_base,
    k_offsets,
    v_base,
    v_offsets,
    src_ptr,
    dst_ptr,
    old_ptr,
    new_ptr,
    table_ptr,
    table_stride,
    n_copies,
    n_layers,
    k_slot_stride,
    k_head_stride,
    v_slot_stride,
    v_head_stride,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    NEOX: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P2: tl.constexpr,
    V_HEADS: tl.constexpr,
    V_HEADS_P2: tl.constexpr,
    V_DIM: tl.constexpr,
    V_DIM_P2: tl.constexpr,
    BLOCK_COPIES: tl.constexpr,
    LAYERS_PER_PROGRAM: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    copy = tl.program_id(0) * BLOCK_COPIES + tl.arange(0, BLOCK_COPIES)
    valid = copy < n_copies
    src = tl.load(src_ptr + copy, mask=valid, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + copy, mask=valid, other=0).to(tl.int64)
    old = tl.load(old_ptr + copy, mask=valid, other=0).to(tl.int64)
    new = tl.load(new_ptr + copy, mask=valid, other=0).to(tl.int64)
    same = old == new
    moved = valid & (src != dst)
    write_k = moved | (valid & (old != new))

    pair = tl.arange(0, HALF_P2)
    pair_ok = pair < HALF
    angle_mask = write_k[:, None] & pair_ok[None, :]
    cos_old = tl.load(table_ptr + old[:, None] * table_stride + pair[None, :], mask=angle_mask, other=1.0)
    sin_old = tl.load(table_ptr + old[:, None] * table_stride + HALF + pair[None, :], mask=angle_mask, other=0.0)
    cos_new = tl.load(table_ptr + new[:, None] * table_stride + pair[None, :], mask=angle_mask, other=1.0)
    sin_new = tl.load(table_ptr + new[:, None] * table_stride + HALF + pair[None, :], mask=angle_mask, other=0.0)
    cos_old = cos_old[:, None, :]
    sin_old = sin_old[:, None, :]
    cos_new = cos_new[:, None, :]
    sin_new = sin_new[:, None, :]

    head = tl.arange(0, HEADS_P2)
    if NEOX:
        first = pair
        second = pair + HALF
    else:
        first = pair * 2
        second = pair * 2 + 1
    k_src = src[:, None, None] * k_slot_stride + head[None, :, None] * k_head_stride
    k_dst = dst[:, None, None] * k_slot_stride + head[None, :, None] * k_head_stride
    k_mask = write_k[:, None, None] & (head < HEADS)[None, :, None] & pair_ok[None, None, :]
    keep_bits = same[:, None, None]

    tail = tl.arange(0, TAIL_P2)
    tail_src = src[:, None, None] * k_slot_stride + head[None, :, None] * k_head_stride + 2 * HALF
    tail_dst = dst[:, None, None] * k_slot_stride + head[None, :, None] * k_head_stride + 2 * HALF
    tail_mask = moved[:, None, None] & (head < HEADS)[None, :, None] & (tail < TAIL)[None, None, :]

    v_head = tl.arange(0, V_HEADS_P2)
    v_dim = tl.arange(0, V_DIM_P2)
    v_src = src[:, None, None] * v_slot_stride + v_head[None, :, None] * v_head_stride + v_dim[None, None, :]
    v_dst = dst[:, None, None] * v_slot_stride + v_head[None, :, None] * v_head_stride + v_dim[None, None, :]
    v_mask = moved[:, None, None] & (v_head < V_HEADS)[None, :, None] & (v_dim < V_DIM)[None, None, :]

    for step in range(LAYERS_PER_PROGRAM):
        layer = tl.program_id(1) * LAYERS_PER_PROGRAM + step
        layer_ok = layer < n_layers
        layer = tl.minimum(layer, n_layers - 1)
        k_offset = tl.load(k_offsets + layer)
        v_offset = tl.load(v_offsets + layer)
        if ALIGNED:
            k_offset = tl.multiple_of(k_offset, 16)
            v_offset = tl.multiple_of(v_offset, 16)
        k_layer = k_base + k_offset
        v_layer = v_base + v_offset

        mask = k_mask & layer_ok
        a = tl.load(k_layer + k_src + first[None, None, :], mask=mask)
        b = tl.load(k_layer + k_src + second[None, None, :], mask=mask)
        a32 = a.to(tl.float32)
        b32 = b.to(tl.float32)
        a_raw = a32 * cos_old + b32 * sin_old
        b_raw = b32 * cos_old - a32 * sin_old
        a_new = (a_raw * cos_new - b_raw * sin_new).to(a.dtype)
        b_new = (b_raw * cos_new + a_raw * sin_new).to(b.dtype)
        tl.store(k_layer + k_dst + first[None, None, :], tl.where(keep_bits, a, a_new), mask=mask)
        tl.store(k_layer + k_dst + second[None, None, :], tl.where(keep_bits, b, b_new), mask=mask)

        if TAIL > 0:
            rest = tl.load(k_layer + tail_src + tail[None, None, :], mask=tail_mask & layer_ok)
            tl.store(k_layer + tail_dst + tail[None, None, :], rest, mask=tail_mask & layer_ok)

        values = tl.load(v_layer + v_src, mask=v_mask & layer_ok)
        tl.store(v_layer + v_dst, values, mask=v_mask & layer_ok)


def check_copies(
    k: LayerBuffers,
    v: LayerBuffers,
    src: torch.Tensor,
    dst: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    rope: RopeTable,
) -> None:
    """Raise ``ValueError`` naming the bad argument and value for any copy list the kernel cannot run
    safely. Reads the index tensors back to the host (one synchronisation)."""
    if k.head_dim != rope.spec.head_dim:
        raise ValueError(f"k head_dim {k.head_dim} differs from rope.spec.head_dim {rope.spec.head_dim}")
    if v.n_layers != k.n_layers or v.n_slots != k.n_slots:
        raise ValueError(f"v has {v.n_layers} layers x {v.n_slots} slots, k has {k.n_layers} x {k.n_slots}")
    if v.device != k.device or rope.table.device != k.device:
        raise ValueError(f"k is on {k.device}, v on {v.device}, rope.table on {rope.table.device}")
    named = {"src": src, "dst": dst, "old_positions": old_positions, "new_positions": new_positions}
    for name, tensor in named.items():
        if tensor.dim() != 1 or tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
        if tensor.shape != src.shape:
            raise ValueError(f"{name} has {tensor.shape[0]} entries, src has {src.shape[0]}")
        if tensor.device != k.device:
            raise ValueError(f"{name} is on {tensor.device}, the KV buffers on {k.device}")
    for name, bound in (("src", k.n_slots), ("dst", k.n_slots), ("old_positions", rope.max_position),
                        ("new_positions", rope.max_position)):
        bad = ((named[name] < 0) | (named[name] >= bound)).nonzero()
        if bad.numel():
            index = int(bad[0])
            raise ValueError(f"{name}[{index}] = {int(named[name][index])} is outside [0, {bound})")
    unique_dst, dst_counts = torch.unique(dst, return_counts=True)
    if (dst_counts > 1).any():
        slot = int(unique_dst[dst_counts > 1][0])
        raise ValueError(f"dst slot {slot} is written by {int(dst_counts[unique_dst == slot])} copies")
    unique_src, src_counts = torch.unique(src, return_counts=True)
    if unique_src.numel():
        at = torch.searchsorted(unique_src, dst).clamp(max=unique_src.numel() - 1)
        readers = torch.where(unique_src[at] == dst, src_counts[at], 0) - (src == dst).to(src_counts.dtype)
        clash = (readers > 0).nonzero()
        if clash.numel():
            index = int(clash[0])
            raise ValueError(f"dst[{index}] = {int(dst[index])} is the src slot of another copy")


def rerotate_kv(
    k: LayerBuffers,
    v: LayerBuffers,
    src: torch.Tensor,
    dst: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    rope: RopeTable,
    *,
    validate: bool = True,
    launch: RerotateLaunch | None = None,
) -> None:
    """Re-rotate K of slots ``src`` from ``old_positions`` to ``new_positions`` into slots ``dst`` at
    every layer (V and the non-rotary tail of K copied where ``src != dst``), in one launch.

    ``validate=False`` skips ``check_copies`` (and its host synchronisation) for callers that built
    the copy list themselves."""
    check_launchable(k.base, "k")
    if validate:
        check_copies(k, v, src, dst, old_positions, new_positions, rope)
    n_copies = int(src.shape[0])
    if n_copies == 0:
        return
    launch = launch or RerotateLaunch.default(n_copies, k)
    half = rope.spec.rotary_dim // 2
    tail = k.head_dim - rope.spec.rotary_dim
    grid = (triton.cdiv(n_copies, launch.block_copies), triton.cdiv(k.n_layers, launch.layers_per_program))
    _rerotate_kernel[grid](
        k.base,
        k.offsets,
        v.base,
        v.offsets,
        src,
        dst,
        old_positions,
        new_positions,
        rope.table,
        rope.table.stride(0),
        n_copies,
        k.n_layers,
        k.base.stride(0),
        k.base.stride(1),
        v.base.stride(0),
        v.base.stride(1),
        HEADS=k.heads,
        HEADS_P2=triton.next_power_of_2(k.heads),
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        NEOX=rope.spec.neox,
        TAIL=tail,
        TAIL_P2=triton.next_power_of_2(max(tail, 1)),
        V_HEADS=v.heads,
        V_HEADS_P2=triton.next_power_of_2(v.heads),
        V_DIM=v.head_dim,
        V_DIM_P2=triton.next_power_of_2(v.head_dim),
        BLOCK_COPIES=launch.block_copies,
        LAYERS_PER_PROGRAM=launch.layers_per_program,
        ALIGNED=k.aligned and v.aligned,
        num_warps=launch.num_warps,
    )
