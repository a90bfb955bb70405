"""Loaded by every Python process of a CPU SGLang server started with this folder on PYTHONPATH
(the launcher, the scheduler and detokenizer subprocesses, multiprocessing's resource tracker): the
same test-side setup as ``scheduler_driver.py`` (torchvision shim, Triton interpreter and its numpy
fix, RotaryEmbedding off vllm's CPU kernel, MiniMax-M2's QK norm on the CPU). Test-only; nothing here
changes SGLang.

The last three are applied when their module is first imported, not here: every process pays for
this file, and only the scheduler runs Triton or the models (importing SGLang's MiniMax-M2 module
alone took ~5 s of a core in each process)."""

import importlib.abc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sglang_patch"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "1"

import cpu_shim  # noqa: E402

cpu_shim.install()


def _interpreter_index(interpreter) -> None:
    """Triton 3.6's interpreter with numpy >= 2.4: a loaded scalar used as an index needs ``__index__``."""
    patch_lang_tensor = interpreter._patch_lang_tensor

    def with_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = with_index


def _rotary_off_vllm(base) -> None:
    base._is_cpu = True


def _minimax_on_cpu(minimax_m2) -> None:
    import cpu_models

    cpu_models.install(minimax_m2)


_AFTER_IMPORT = {"triton.runtime.interpreter": _interpreter_index,
                 "sglang.srt.layers.rotary_embedding.base": _rotary_off_vllm,
                 "sglang.srt.models.minimax_m2": _minimax_on_cpu}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``_AFTER_IMPORT[name]`` on module ``name`` right after the module's own code ran."""

    def find_spec(self, name, path=None, target=None):
        patch = _AFTER_IMPORT.get(name)
        if patch is None:
            return None
        spec = next(filter(None, (f.find_spec(name, path, target) for f in sys.meta_path if f is not self)), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


for _name in [n for n in _AFTER_IMPORT if n in sys.modules]:  # imported by the shim already
    _AFTER_IMPORT.pop(_name)(sys.modules[_name])
sys.meta_path.insert(0, _AfterImport())
