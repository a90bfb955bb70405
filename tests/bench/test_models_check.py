"""bench/akv_models_check.py's parts, deadline and bounds. Its CPU dry run end to end (gpt-oss-tiny and
minimax-m2-tiny on the patched CPU server, FP32, against the exact reference server, with drops and
repositions) runs in tests/sglang_cpu/test_demo_models.py, on the servers the demo runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import akv_models_check
from bench.harness import oracle


def test_parts_are_skipped_past_the_deadline_or_unasked_and_every_part_is_written_at_once(tmp_path: Path) -> None:
    args = akv_models_check.parse_args(["--out", str(tmp_path), "--deadline-s", "100",
                                        "--parts", "gpt_oss_tiny,minimax_tiny"])
    run = akv_models_check.Run(args)
    seen = []

    def check() -> dict:
        seen.append(json.loads((tmp_path / "akv_models_check.json").read_text())["parts"]["gpt_oss_tiny"])
        raise RuntimeError("server exited")

    run.part("gpt_oss_tiny", check, need_s=10)
    run.part("minimax_tiny", lambda: {"ok": True}, need_s=1000)
    run.part("gpt_oss_20b", lambda: {"ok": True}, need_s=0)
    parts = json.loads((tmp_path / "akv_models_check.json").read_text())["parts"]
    assert seen[0]["ok"] is None and seen[0]["cut"].startswith("started at")  # a cut run says where it stopped
    assert parts["gpt_oss_tiny"]["ok"] is False and "server exited" in parts["gpt_oss_tiny"]["error"]
    assert parts["minimax_tiny"] == {"ok": None, "skipped": parts["minimax_tiny"]["skipped"]}
    assert parts["minimax_tiny"]["skipped"].startswith("needs ~1000 s")
    assert parts["gpt_oss_20b"] == {"ok": None, "skipped": "not in --parts"}


def test_a_server_is_waited_for_until_the_deadline_unless_told_otherwise(tmp_path: Path) -> None:
    """A slow CPU start (gpt-oss's warm-up compiles with inductor: over 420 s on a loaded CI machine)
    is waited for as long as the run's deadline allows, not cut at a fixed time."""
    waited: list[float] = []

    class Server:
        def wait(self, timeout: float) -> None:
            waited.append(timeout)

    for argv, expected in ((["--dry-run"], 2400.0), (["--dry-run", "--ready-timeout", "30"], 30.0),
                           (["--deadline-s", "5"], 10.0)):
        run = akv_models_check.Run(akv_models_check.parse_args(["--out", str(tmp_path), *argv]))
        run.servers["s"], run.launched["s"], run.report["servers"]["s"] = Server(), run.started, {}
        run.ready("s")
        assert waited[-1] == pytest.approx(expected, abs=5.0), argv


def test_with_plain_requests_scored_on_their_first_token_the_bound_is_a_first_token_one() -> None:
    """gpt-oss: plain requests are compared on one token, context ones on eight; the bound the plain
    ones set applies to the context requests' first tokens, and a context request is refused when
    its own first token is off by more (its later tokens accumulate decode noise the plain ones
    never show)."""
    usage = {"prompt_tokens": 90, "prompt_tokens_details": None}

    def row(error: float, first: float) -> dict:
        return {"error": error, "first_token_error": first, "margin_at_split": None, "usage": usage,
                "reference_usage": usage}

    drift = {"plain-a": row(0.10, 0.10), "plain-b": row(0.02, 0.02), "context-a": row(0.17, 0.08)}
    assert oracle.verdict(drift, first_token_bound=True)["failures"] == []
    assert oracle.verdict(drift)["failures"] == ["context-a: log-prob error 0.170 > 1.5 x plain 0.100"]
    wrong = {**drift, "context-b": row(0.20, 0.20)}
    assert oracle.verdict(wrong, first_token_bound=True)["failures"] == [
        "context-b: log-prob error 0.200 > 1.5 x plain 0.100"]


def test_the_120b_part_runs_only_when_named_and_its_servers_one_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """gpt-oss-120b (~65 GB in mxfp4) cannot share the card with a second copy: the patched server is
    stopped before stock starts, and the plain tokens of the two runs are compared."""
    assert "gpt_oss_120b" not in akv_models_check.parse_args(["--out", str(tmp_path / "a")]).parts
    run = akv_models_check.Run(akv_models_check.parse_args(["--out", str(tmp_path / "b"), "--parts", "gpt_oss_120b"]))
    up: list[str] = []
    events: list[str] = []

    class Server:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self, timeout: float) -> None:
            pass

        def stop(self) -> None:
            up.remove(self.name)
            events.append(f"stop {self.name}")

    def launch(side: str) -> None:
        name = f"gpt_oss_120b_{side}"
        assert not up, f"{name} launched while {up} is up"
        up.append(name)
        events.append(f"launch {name}")
        run.servers[name], run.launched[name], run.report["servers"][name] = Server(name), run.started, {}

    def reply(text: str) -> dict:
        return {"usage": {"prompt_tokens": 9}, "choices": [{"logprobs": {"content": [
            {"token": t, "logprob": -0.5} for t in text]}}]}

    said = {"gpt_oss_120b_patched": "abc", "gpt_oss_120b_stock": "abd"}
    monkeypatch.setattr(akv_models_check.big, "plain_replies", lambda server, tok: [reply(said[server.name])])
    monkeypatch.setattr(akv_models_check.big, "check_ten_turns", lambda server, tok: {"ok": True, "on": server.name})
    monkeypatch.setattr(akv_models_check.big, "check_equivalence", lambda server, tok: {"ok": True})
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda model: None)
    out = akv_models_check.check_big_in_turn(run, "gpt_oss_120b", tmp_path, launch)
    assert events == ["launch gpt_oss_120b_patched", "stop gpt_oss_120b_patched", "launch gpt_oss_120b_stock",
                      "stop gpt_oss_120b_stock"]
    assert out["ten_turns"]["on"] == "gpt_oss_120b_patched"
    assert out["plain_identity"]["rows"][0]["identical"] is False and out["ok"] is False
