"""``python -m akv.system.launch_router``: refuses a router that drops the AKV fields (sglang-router)
with a message saying why, refuses an untested smg, adds conversation affinity unless given, and
passes every other flag to ``smg launch``."""

from __future__ import annotations

import sys

import pytest

from akv.system import launch_router as lr

SMG = {"smg": "1.13.0", "sglang-router": None}


def test_sglang_router_instead_of_smg_is_refused_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert lr.main(["--worker-urls", "http://127.0.0.1:1"], {"smg": None, "sglang-router": "0.3.2"}) == 2
    message = capsys.readouterr().err
    assert "sglang-router 0.3.2 is installed but smg is not" in message
    assert "without drop_message and reposition" in message and "plain request" in message
    assert 'pip install "smg==1.13.0"' in message


@pytest.mark.parametrize(("versions", "needle"), [
    ({"smg": None, "sglang-router": None}, "smg is not installed"),
    ({"smg": "1.12.4", "sglang-router": None}, "smg 1.12.4 is not the tested series 1.13.x"),
    ({"smg": "2.0.0", "sglang-router": "0.3.2"}, "smg 2.0.0 is not the tested series 1.13.x"),
])
def test_a_missing_or_untested_smg_is_refused(versions: dict, needle: str) -> None:
    with pytest.raises(lr.RouterError, match=needle):
        lr.check_router(versions)


def test_smg_1_13_is_used_even_beside_sglang_router() -> None:
    assert lr.check_router({"smg": "1.13.0", "sglang-router": "0.3.2"}) == "1.13.0"
    assert lr.check_router({"smg": "1.13.2", "sglang-router": None}) == "1.13.2"


def test_affinity_is_added_and_other_flags_pass_through_in_order() -> None:
    argv = ["--worker-urls", "http://a:1", "http://b:2", "--port", "9000", "--max-idle-secs=60"]
    assert lr.router_command(argv) == [sys.executable, "-m", "smg", "launch", *argv, "--policy", "least_load",
                                       "--routing-key-override"]


@pytest.mark.parametrize("given", [["--policy", "round_robin"], ["--policy=manual"], ["--sticky-sessions"],
                                   ["--routing-key-override", "--policy", "cache_aware"]])
def test_given_policy_or_stickiness_is_kept(given: list[str]) -> None:
    out = lr.with_affinity(given)
    assert out[:len(given)] == given
    assert sum(a.partition("=")[0] == "--policy" for a in out) == 1
    assert len({"--routing-key-override", "--sticky-sessions"} & set(out)) == 1


def test_the_installed_versions_are_read_from_package_metadata() -> None:
    versions = lr.installed_versions()
    assert set(versions) == {"smg", "sglang-router"}


def test_version_and_help_need_no_router(capsys: pytest.CaptureFixture[str]) -> None:
    assert lr.main(["--version"], {"smg": None, "sglang-router": None}) == 0
    assert "smg not installed" in capsys.readouterr().out
    assert lr.main(["--help"], {"smg": None, "sglang-router": "0.3.2"}) == 0
    assert capsys.readouterr().out.startswith("usage:")
