"""Make SGLang 0.5.16's server modules importable on a CPU-only machine without torchvision.

Import and call :func:`install` before anything from ``sglang``. With a working torchvision it does
nothing. Otherwise it (1) lets transformers record "torchvision unavailable" first, (2) serves
``torchvision`` and its submodules as inert mock modules, and (3) pre-seeds
``sglang.srt.configs.utils`` with no-op processor registration, which transformers 5 refuses
without torchvision. Test-only code.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _MockMeta(type):
    """Classes whose every missing attribute is another mock class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _mock_class(f"{cls.__name__}.{name}")


def _mock_class(name: str) -> type:
    return _MockMeta(name, (), {"__init__": lambda self, *args, **kwargs: None,
                                "__call__": lambda self, *args, **kwargs: None})


class _MockModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _mock_class(f"{self.__name__}.{name}")


class _MockLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MockModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, _MockLoader(), is_package=True)
        return None


def install() -> None:
    """Install the shim (idempotent)."""
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - a broken torchvision fails in many ways (OSError, RuntimeError, ...)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    if any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()
    sys.meta_path.insert(0, _TorchvisionFinder())
    configs_utils = types.ModuleType("sglang.srt.configs.utils")
    configs_utils.register_image_processor = lambda *args, **kwargs: None
    configs_utils.register_processor = lambda *args, **kwargs: None
    sys.modules["sglang.srt.configs.utils"] = configs_utils
