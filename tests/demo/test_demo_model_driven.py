"""Without --scripted the model's own tool calls drive the loop. A stand-in for a capable model (a small
SSE server that reads the conversation and answers as a good agent would) checks the harness side:
calls executed, drop_context receipts honoured, AKV fields sent, the final answer detected."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from akv_demo.harness import DemoConfig, run_demo  # noqa: E402
from akv_demo.records import ShipmentChain  # noqa: E402

CHAIN = 4


class _AgentModel(BaseHTTPRequestHandler):
    """Follows the chain: reads the record the last tool result names; with the drop tool offered it
    also asks to drop every record but the newest; answers once a record gives the destination."""

    requests: list[dict[str, Any]] = []

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        messages = body["messages"]
        tool_names = {t["function"]["name"] for t in body.get("tools", [])}
        records = [i for i, m in enumerate(messages) if m["role"] == "tool" and m["content"].startswith("RECORD")]
        last = messages[records[-1]]["content"] if records else messages[1]["content"]
        final = re.search(r"FINAL DESTINATION: (.+?)\. This", last)
        if final:
            delta: dict[str, Any] = {"content": f"It ended up at {final.group(1)}."}
        else:
            target = re.findall(r"record (R-\d+)", last)[-1]
            calls = [("read_record", {"record_id": target})]
            dropped = {i for m in messages if m["role"] == "tool" and '"scheduled"' in m["content"]
                       for i in json.loads(m["content"])["message_ids"]}
            stale = [i for i in records[:-1] if i not in dropped]
            if "drop_context" in tool_names and stale:
                calls.append(("drop_context", {"message_ids": stale}))
            delta = {"tool_calls": [{"index": k, "id": f"call_{len(messages)}_{k}", "type": "function",
                                     "function": {"name": name, "arguments": json.dumps(args)}}
                                    for k, (name, args) in enumerate(calls)]}
        usage = {"prompt_tokens": 100 * len(messages), "completion_tokens": 5, "total_tokens": 100 * len(messages) + 5,
                 "prompt_tokens_details": {"cached_tokens": 0, "repos_tokens": 0, "drop_skipped_tokens": 0}}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"index": 0, "delta": delta}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop" if final else "tool_calls"}]},
                  {"choices": [], "usage": usage}]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def agent_model() -> Iterator[str]:
    _AgentModel.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AgentModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("policy", ["turn", "model"])
def test_model_driven_loop(agent_model: str, tmp_path: Path, policy: str) -> None:
    result = run_demo(DemoConfig(base_url=agent_model, model="agent", output=tmp_path / "run", policy=policy,
                                 steps=CHAIN, manifest_lines=3), log=lambda line: None)
    chain = ShipmentChain.generate(CHAIN, manifest_lines=3, seed=7)
    assert result.chain_completed and result.records_read == chain.ids
    assert result.final_answer == f"It ended up at {chain.final_location}."
    sent = _AgentModel.requests
    assert len(sent) == CHAIN + 1
    assert sent[-1].get("drop_message") and sent[-1].get("reposition")
    hidden = {i for ids in sent[-1]["drop_message"].values() for i in ids}
    record_ids = [i for i, m in enumerate(sent[-1]["messages"]) if m["role"] == "tool"
                  and m["content"].startswith("RECORD")]
    assert hidden and hidden <= set(record_ids[:-1])
    if policy == "model":
        assert any(t["function"]["name"] == "drop_context" for t in sent[0]["tools"])
        receipts = [json.loads(m["content"]) for m in sent[-1]["messages"] if m["role"] == "tool"
                    and '"status"' in m["content"]]
        assert receipts and all(r["status"] == "scheduled" for r in receipts)
