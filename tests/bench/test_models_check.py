"""tools/gpu/akv_models_check.py's CPU dry run end to end (slow): gpt-oss-tiny and minimax-m2-tiny
on the patched CPU server (FP32) against the exact reference server, with drops and repositions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
import akv_models_check  # noqa: E402


@pytest.mark.slow
def test_dry_run_serves_both_tiny_models_like_the_reference_server(tmp_path: Path) -> None:
    try:
        from akv.system.models.gpt_oss import chat_template
        from akv.system.models.minimax_m2 import TEMPLATE_NAME
        from akv.system.models.pypi_files import FetchError
        from akv.system.models.sdist_templates import TemplateFetchError, official_template

        chat_template()
        official_template(TEMPLATE_NAME)
    except (FetchError, TemplateFetchError) as exc:
        pytest.skip(f"model maker files not cached and not downloadable: {exc}")
    out = tmp_path / "out"
    assert akv_models_check.main(["--dry-run", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads((out / "akv_models_check.json").read_text())
    for name in ("gpt_oss_tiny", "minimax_tiny"):
        part = report["parts"][name]
        assert part["ok"] and part["failures"] == [], (name, part)
        rows = part["requests"]
        context = [r for n, r in rows.items() if n.startswith("context")]
        assert len(context) == 6 and len(rows) == 16, name
        assert all(r["agree"] == r["n"] for r in rows.values()), name  # FP32: every token as the reference's
        details = [r["usage"]["prompt_tokens_details"] for r in context]
        assert all(d["drop_skipped_tokens"] > 0 for d in details) and any(d["repos_tokens"] > 0 for d in details)
    assert {report["parts"][n]["skipped"] for n in ("gpt_oss_20b", "minimax_dummy")} == {"dry run: H200 only"}
