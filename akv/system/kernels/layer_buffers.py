"""One KV pool's per-layer buffers described for a single all-layer kernel launch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LayerBuffers:
    """``n_layers`` buffers of shape ``[n_slots, heads, head_dim]`` (one per layer, like SGLang's
    ``k_buffer``/``v_buffer`` lists, or the slices of a stacked ``[layers, slots, heads, head_dim]``
    tensor). A kernel addresses layer ``l`` as ``base + offsets[l]`` (element offsets, int64);
    ``aligned`` says every offset is a multiple of 16 elements, which lets kernels vectorise."""

    layers: tuple[torch.Tensor, ...]
    base: torch.Tensor
    offsets: torch.Tensor
    aligned: bool

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor] | torch.Tensor, *, name: str = "buffers") -> LayerBuffers:
        """Describe a list of per-layer buffers or one stacked 4-D tensor; all layers must share
        shape, dtype, device and strides, with a contiguous last dimension."""
        if isinstance(buffers, torch.Tensor):
            if buffers.dim() != 4:
                raise ValueError(f"{name}: a stacked buffer must be 4-D [layers, slots, heads, dim], got {tuple(buffers.shape)}")
            layers = tuple(buffers.unbind(0))
        else:
            layers = tuple(buffers)
        if not layers:
            raise ValueError(f"{name}: needs at least one layer")
        first = layers[0]
        if first.dim() != 3:
            raise ValueError(f"{name}[0]: expected [slots, heads, dim], got shape {tuple(first.shape)}")
        if first.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}[0]: dtype {first.dtype} is not one of {SUPPORTED_DTYPES}")
        if first.stride(-1) != 1:
            raise ValueError(f"{name}[0]: last dimension must be contiguous, strides {first.stride()}")
        for index, layer in enumerate(layers[1:], start=1):
            for what, got, want in (
                ("shape", tuple(layer.shape), tuple(first.shape)),
                ("dtype", layer.dtype, first.dtype),
                ("device", layer.device, first.device),
                ("strides", layer.stride(), first.stride()),
            ):
                if got != want:
                    raise ValueError(f"{name}[{index}]: {what} {got} differs from layer 0's {want}")
        size = first.element_size()
        deltas = [layer.data_ptr() - first.data_ptr() for layer in layers]
        if any(delta % size for delta in deltas):
            raise ValueError(f"{name}: layer base addresses are not aligned to the {size}-byte element size")
        elements = [delta // size for delta in deltas]
        offsets = torch.tensor(elements, dtype=torch.int64, device=first.device)
        return cls(layers=layers, base=first, offsets=offsets, aligned=all(e % 16 == 0 for e in elements))

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_slots(self) -> int:
        return int(self.base.shape[0])

    @property
    def heads(self) -> int:
        return int(self.base.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.base.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot of one layer."""
        return self.heads * self.head_dim * self.base.element_size()
