"""Load the reference model that fits a model directory's ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from akv.system.reference.gpt_oss import GptOssReferenceModel
from akv.system.reference.minimax_m2 import MiniMaxM2Model
from akv.system.reference.model import ReferenceModel


def load_reference_model(path: str | Path, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> ReferenceModel | GptOssReferenceModel:
    """:class:`GptOssReferenceModel` for ``GptOssForCausalLM``, :class:`MiniMaxM2Model` for
    ``MiniMaxM2ForCausalLM``, else :class:`ReferenceModel` (which reports an unreadable or
    unsupported config itself), its weights on ``device``."""
    root = Path(path)
    try:
        architectures = json.loads((root / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        architectures = None
    if architectures == ["GptOssForCausalLM"]:
        return GptOssReferenceModel.from_pretrained(root, dtype, device)
    if architectures == ["MiniMaxM2ForCausalLM"]:
        return MiniMaxM2Model.from_pretrained(root, dtype, device)
    return ReferenceModel.from_pretrained(root, dtype, device)
