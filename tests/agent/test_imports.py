"""`import akv.agent` uses the standard library only; the token counter imports its extra lazily."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from akv.agent import CachePolicy, HistoryError, PayloadError, TurnReposition, TurnSelection, extra_body

from .conversations import call, payload, result

THIRD_PARTY = ("torch", "numpy", "transformers", "jinja2", "tokenizers", "safetensors", "triton", "pydantic",
               "hypothesis", "akv.system")


def modules_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("statement", ["import akv.agent", "import akv.agent.tokens",
                                       "from akv.agent import *"])
def test_imports_only_the_standard_library(statement):
    baseline = set(modules_after("pass"))
    added = set(modules_after(statement)) - baseline
    assert not [m for m in added if m.split(".")[0] in THIRD_PARTY or m.startswith("akv.system")]
    foreign = {m.split(".")[0] for m in added} - set(sys.stdlib_module_names) - {"akv"}
    assert foreign == set()


def test_extra_body_helper_for_the_openai_sdk():
    messages = [{"role": "user", "content": "task"}, call("A"), result("A"), call("B"), result("B")]
    _, history = CachePolicy(selector=TurnSelection(1), reposition=TurnReposition(after=2)).process(payload(messages))
    assert extra_body(history) == {"drop_message": {"4": [2]}, "reposition": [4]}
    assert extra_body(history, {"top_k": 20}) == {"top_k": 20, "drop_message": {"4": [2]}, "reposition": [4]}
    with pytest.raises(HistoryError, match="extra_body: history must be a CacheOperationHistory, got dict"):
        extra_body({"drop_message": {}})  # type: ignore[arg-type]
    with pytest.raises(PayloadError, match="extra_body: base must be a mapping or None, got list") as info:
        extra_body(history, [("top_k", 20)])  # type: ignore[arg-type]
    assert info.value.field == "extra_body"
