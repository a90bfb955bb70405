"""On the GPU machine (tools/gpu/run.sh installs the AKV site): SGLang's real HTTP layer answers a
bad ``drop_message``/``reposition`` with 400 naming the field, before any model work."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

BODY = {
    "model": "default",
    "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}],
    "max_tokens": 4,
}


@pytest.fixture(scope="module")
def client():
    http_server = pytest.importorskip("sglang.srt.entrypoints.http_server")
    testclient = pytest.importorskip("fastapi.testclient")
    return testclient.TestClient(http_server.app)


def test_installed_sglang_is_the_akv_build() -> None:
    sglang = pytest.importorskip("sglang")
    assert sglang.__version__ == "0.5.16+akv"


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"drop_message": {"1": [2]}}, ["drop_message['1'][0]", "after its anchor 1"]),
        ({"drop_message": {"1": ["0"]}}, ["drop_message['1'][0]", "str, not an int"]),
        ({"reposition": [2, 0]}, ["reposition[1]", "not greater than the previous anchor 2"]),
        ({"reposition": [3]}, ["reposition[0]", "out of range for 3 messages"]),
    ],
)
def test_bad_fields_get_400_naming_the_field(client, fields: dict, needles: list[str]) -> None:
    response = client.post("/v1/chat/completions", json={**BODY, **fields})
    assert response.status_code == 400, response.text
    for needle in needles:
        assert needle in response.text
