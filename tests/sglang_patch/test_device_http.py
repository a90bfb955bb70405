"""On the GPU machine (tools/gpu/run.sh installs the AKV site): the installed sglang is the AKV build.

The HTTP answers themselves (400 naming the field, usage counters) are checked against a running
server: on the CPU by tests/sglang_cpu/test_http.py, on the H200 by tools/gpu/smoke_client.py and
bench/akv_served_check.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_installed_sglang_is_the_akv_build() -> None:
    sglang = pytest.importorskip("sglang")
    assert sglang.__version__ == "0.5.16+akv"
