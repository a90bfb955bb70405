"""Loaded by every Python process of a CPU SGLang server started with this folder on PYTHONPATH
(the launcher, the scheduler and detokenizer subprocesses): the same test-side setup as
``scheduler_driver.py`` (torchvision shim, Triton interpreter and its numpy fix, RotaryEmbedding
off vllm's CPU kernel, MiniMax-M2's QK norm on the CPU). Test-only; nothing here changes SGLang."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sglang_patch"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "1"

import cpu_shim  # noqa: E402

cpu_shim.install()

from triton.runtime import interpreter  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor


def _with_index(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _with_index

import sglang.srt.layers.rotary_embedding.base as _rotary_base  # noqa: E402

_rotary_base._is_cpu = True

import cpu_models  # noqa: E402

cpu_models.install()
