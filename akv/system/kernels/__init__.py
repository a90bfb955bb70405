"""GPU kernels: RoPE re-rotation of KV slots and visibility-aware attention index lists, each with a
plain PyTorch reference beside it."""

from akv.system.kernels.kv_indices import (
    ExtendKVMetadata,
    HiddenRanges,
    KeepMask,
    KVIndexLists,
    VisibleUntil,
    decode_kv_indices,
    extend_kv_indices,
    visible_kv_indices,
)
from akv.system.kernels.kv_indices_reference import visible_kv_indices_reference
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import RerotateLaunch, check_copies, rerotate_kv
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec, RopeTable

__all__ = [
    "ExtendKVMetadata",
    "HiddenRanges",
    "KVIndexLists",
    "KeepMask",
    "LayerBuffers",
    "RerotateLaunch",
    "RopeSpec",
    "RopeTable",
    "VisibleUntil",
    "check_copies",
    "decode_kv_indices",
    "extend_kv_indices",
    "rerotate_kv",
    "rerotate_kv_reference",
    "visible_kv_indices",
    "visible_kv_indices_reference",
]
