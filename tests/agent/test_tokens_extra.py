"""The token counter without the ``tokenization`` extra: an AKVError that says how to install it."""

from __future__ import annotations

import sys

import pytest

from akv.agent import AKVError, MissingExtraError
from akv.agent.tokens import ChatTemplateTokenCounter


@pytest.mark.parametrize("missing", ["transformers", "jinja2"])
def test_a_missing_extra_is_an_akv_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    for name in list(sys.modules):
        if name == missing or name.startswith(missing + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # import of it raises ImportError
    for build in (lambda: ChatTemplateTokenCounter.from_pretrained("/nonexistent"),
                  lambda: ChatTemplateTokenCounter(object(), chat_template="{{ 1 }}")):
        with pytest.raises(MissingExtraError) as info:
            build()
        assert isinstance(info.value, AKVError) and isinstance(info.value, ImportError)
        assert "'tokenization' extra" in str(info.value) and "pip install -e '.[tokenization]'" in str(info.value)
        assert missing in str(info.value)
