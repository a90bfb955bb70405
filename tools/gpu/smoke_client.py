"""Smoke requests against a running patched server (standard library and ``akv.cli`` only).

``python tools/gpu/smoke_client.py --base http://127.0.0.1:30000 --json OUT.json``

Each check is timed and recorded; a failing check does not stop the others. Exit status 0 when all
passed. Random weights make the text meaningless: checks are about protocol shape and status codes.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from akv import cli  # noqa: E402

TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does cache mean?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"word\": \"cache\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a store of things kept for later use " * 20},
    {"role": "user", "content": "Thanks. And prefix?"},
]


class HttpResult:
    """Status code and decoded JSON (or text) of one response, and the request body that got it."""

    def __init__(self, status: int, body: Any, sent: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        self.sent = sent

    def __str__(self) -> str:
        return f"HTTP {self.status}: {str(self.body)[:1500]}; request body: {json.dumps(self.sent)[:1000]}"


def post(base: str, path: str, body: dict[str, Any], timeout: float) -> HttpResult:
    """Any status is a result (the checks expect 400s too)."""
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return HttpResult(response.status, _decode(response.read()), body)
    except urllib.error.HTTPError as exc:
        return HttpResult(exc.code, _decode(exc.read()), body)


def post_stream(base: str, path: str, body: dict[str, Any], timeout: float) -> list[Any]:
    """SSE ``data:`` payloads of a streamed response, ``"[DONE]"`` kept as a string."""
    events: list[Any] = []
    with cli.open_request(base + path, body, timeout) as response:
        assert response.status == 200, response.status
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:"):
                payload = line[5:].strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _decode(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 16, "temperature": 0,
            **fields}


def _expect_ok(result: HttpResult) -> dict[str, Any]:
    assert result.status == 200, str(result)
    choice = result.body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    usage = result.body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, usage
    return {"usage": usage, "finish_reason": choice["finish_reason"]}


def _expect_400(result: HttpResult, *needles: str) -> dict[str, Any]:
    text = json.dumps(result.body)
    assert result.status == 400, f"expected HTTP 400, got {result}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in error {text[:500]}"
    return {"error": text[:300]}


def run_checks(base: str, timeout: float) -> dict[str, dict[str, Any]]:
    model = cli.request_json(base + "/v1/models", timeout=timeout)["data"][0]["id"]

    def server_info() -> dict[str, Any]:
        info = cli.request_json(base + "/server_info", timeout=timeout)
        seen = {key: info.get(key) for key in ("version", "page_size", "attention_backend")}
        # the launcher's default backend: flashinfer on a CUDA device with FlashInfer, triton elsewhere
        assert seen["version"] == "0.5.16+akv" and seen["page_size"] == 1, seen
        assert seen["attention_backend"] in ("triton", "flashinfer"), seen
        return seen

    def plain_chat() -> dict[str, Any]:
        return _expect_ok(post(base, "/v1/chat/completions",
                               {"model": model, "messages": [{"role": "user", "content": "Hello there"}],
                                "max_tokens": 16, "temperature": 0}, timeout))

    def chat_stream_tools() -> dict[str, Any]:
        events = post_stream(base, "/v1/chat/completions",
                             _chat(model, stream=True, stream_options={"include_usage": True}), timeout)
        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [e for e in events if isinstance(e, dict)]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] > 0, chunks[-2:]
        return {"chunks": len(chunks), "usage": usage[-1]}

    def context_fields() -> dict[str, Any]:
        return _expect_ok(post(base, "/v1/chat/completions",
                               _chat(model, drop_message={"3": [3]}, reposition=[3]), timeout))

    def context_fields_stream() -> dict[str, Any]:
        events = post_stream(base, "/v1/chat/completions",
                             _chat(model, drop_message={"3": [2, 3]}, reposition=[3, 4], stream=True,
                                   stream_options={"include_usage": True}), timeout)
        assert events and events[-1] == "[DONE]", events[-3:]
        return {"chunks": len(events) - 1}

    def bad_future_drop() -> dict[str, Any]:
        return _expect_400(post(base, "/v1/chat/completions", _chat(model, drop_message={"1": [2]}), timeout),
                           "drop_message['1'][0]", "after its anchor 1")

    def bad_reposition_order() -> dict[str, Any]:
        return _expect_400(post(base, "/v1/chat/completions", _chat(model, reposition=[3, 1]), timeout),
                           "reposition[1]")

    def bad_type_not_coerced() -> dict[str, Any]:
        return _expect_400(post(base, "/v1/chat/completions", _chat(model, reposition=["3"]), timeout),
                           "reposition[0]", "str")

    def unsupported_n() -> dict[str, Any]:
        return _expect_400(post(base, "/v1/chat/completions", _chat(model, reposition=[3], n=2), timeout),
                           "n: drop_message/reposition need n == 1")

    def plain_after_bad() -> dict[str, Any]:
        return _expect_ok(post(base, "/v1/chat/completions", _chat(model), timeout))

    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("server_info", server_info),
        ("plain_chat", plain_chat),
        ("chat_stream_tools", chat_stream_tools),
        ("context_fields", context_fields),
        ("context_fields_stream", context_fields_stream),
        ("bad_future_drop", bad_future_drop),
        ("bad_reposition_order", bad_reposition_order),
        ("bad_type_not_coerced", bad_type_not_coerced),
        ("unsupported_n", unsupported_n),
        ("plain_after_bad", plain_after_bad),
    ]
    results: dict[str, dict[str, Any]] = {}
    for name, check in checks:
        start = time.perf_counter()
        try:
            detail, ok = check(), True
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, the next check still runs
            detail, ok = {"error": f"{type(exc).__name__}: {exc}"[:3000]}, False
        results[name] = {"ok": ok, "seconds": round(time.perf_counter() - start, 3), **detail}
        print(f"[smoke] {name}: {'ok' if ok else 'FAIL'} {results[name]}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(None, __doc__.split("\n\n")[0])
    parser.add_argument("--base", default="http://127.0.0.1:30000")
    parser.add_argument("--json", type=cli.new_file, help="write the results to this new file")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    results = run_checks(args.base, args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
