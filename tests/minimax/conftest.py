"""A session-scoped tiny MiniMax-M2 directory (official template fetched once, cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from akv.system.models.minimax_m2 import make_minimax_m2_tiny
from akv.system.models.sdist_templates import TemplateFetchError


@pytest.fixture(scope="session")
def minimax_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return make_minimax_m2_tiny(tmp_path_factory.mktemp("minimax-m2-tiny"))
    except TemplateFetchError as exc:
        pytest.skip(f"official MiniMax-M2 template unavailable: {exc}")
