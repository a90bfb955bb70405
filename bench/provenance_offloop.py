"""Provenance + compile of a long conversation, and whether the HTTP server keeps answering meanwhile
(CPU; issue 10).

Run: ``python bench/provenance_offloop.py --out bench/results/provenance_offloop.json``.

- ``convert``: a 3,200-message tool conversation (Qwen3 chat template, the tiny model's tokenizer)
  rendered and encoded the way SGLang's chat handler does (``apply_chat_template(tokenize=False)``
  + ``encode``) against AKV's provenance + compile of the same request with a rolling drop and a
  periodic reposition (``akv.system.adapter.serving.compile_context_program``, given SGLang's
  prompt ids as the serving hook is: with this byte-level BPE tokenizer they are not encoded
  again); medians, and their ratio. ``of_which_plain_render_check``: the plain render provenance
  repeats to check its instrumented render (SGLang has just rendered the same text); only
  templates that can read back their own output (macros, ``set``/``filter``/call blocks) pay it,
  so not this Qwen3 one.
- ``http``: the patched server on the CPU (``akv.system.launch_server``, tiny FP32 Qwen3, the
  test-side setup of ``tests/sglang_cpu/site``). A short plain request alone, then the same short
  request sent over and over while the long context request is in the server: the short
  request's latency, and how many of them were answered before the long one. The long request
  is answered 400 by design (its ~250k tokens exceed the tiny model's context), after SGLang
  rendered it and AKV compiled it: that conversion is what is measured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compiler import _agent_fields, _tool_conversation  # noqa: E402

from akv import cli  # noqa: E402
from akv.system.models.tiny import make_tiny_model  # noqa: E402
from bench.harness import results, servers  # noqa: E402

TEMPLATE = ROOT / "tests" / "context" / "templates" / "qwen3.jinja"
SHORT = [{"role": "user", "content": "Say hi."}]


def _interleaved(fns: dict[str, Any], repeats: int) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Median wall and CPU ms of each function, run in turn ``repeats`` times (so a busy machine
    slows all of them alike), and each one's last result."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
    medians = {name: {"wall_ms": round(statistics.median(wall[name]), 1), "cpu_ms": round(statistics.median(cpu[name]), 1)}
               for name in fns}
    return medians, results


def long_request(calls: int) -> dict[str, Any]:
    messages = _tool_conversation(calls)
    drops, repos = _agent_fields(len(messages), keep=8, repos_every=10)
    return {"messages": messages, "drop_message": drops, "reposition": repos}


def run_convert(model: Path, calls: int, repeats: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from akv.system.adapter.serving import compile_context_program
    from akv.system.context.provenance import chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    body = long_request(calls)
    messages = body["messages"]

    def stock() -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=None,
                                             return_dict=False)
        return tokenizer.encode(text, add_special_tokens=False)

    prompt_ids = stock()
    request = SimpleNamespace(messages=messages, drop_message=body["drop_message"], reposition=body["reposition"],
                              akv_unknown_fields=None)
    medians, results = _interleaved({
        "sglang_render_encode": stock,
        "akv_provenance_compile": lambda: compile_context_program(request, tokenizer, messages, None, {}, prompt_ids),
        "of_which_plain_render_check": lambda: chat_template(tokenizer.chat_template).render(
            messages, **tokenizer.special_tokens_map),
    }, repeats)
    stock_ms, akv_ms = medians["sglang_render_encode"], medians["akv_provenance_compile"]
    return {"messages": len(messages), "prompt_tokens": len(prompt_ids),
            "events": len(results["akv_provenance_compile"].events), **medians,
            "ratio_cpu": round(akv_ms["cpu_ms"] / stock_ms["cpu_ms"], 2),
            "ratio_wall": round(akv_ms["wall_ms"] / stock_ms["wall_ms"], 2), "repeats": repeats}


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[int, float, str]:
    """Status, seconds and the error message (empty on success) of one chat request."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status, time.perf_counter() - start, ""
    except urllib.error.HTTPError as error:
        message = json.loads(error.read().decode()).get("message", "")
        return error.code, time.perf_counter() - start, message


def _short(url: str) -> tuple[int, float, str]:
    return _post(url, {"model": "default", "messages": SHORT, "max_tokens": 2, "temperature": 0.0})


def run_http(model: Path, work: Path, calls: int, alone_repeats: int) -> dict[str, Any]:
    site = servers.cpu_pythonpath(servers.cpu_patched_site(work))
    server = servers.launch("patched", "akv.system.launch_server", model, servers.cpu_flags(4096, chunk=16),
                            {**os.environ, "PYTHONPATH": site}, servers.free_port(), work / "server.log")
    url = server.url
    try:
        server.wait(900)
        _short(url)
        alone = [_short(url)[1] for _ in range(alone_repeats)]
        body = {"model": "default", "max_tokens": 1, "temperature": 0.0, **long_request(calls)}
        done: dict[str, Any] = {}

        def send_long() -> None:
            done["status"], done["seconds"], done["message"] = _post(url, body)
            done["at"] = time.perf_counter()

        thread = threading.Thread(target=send_long)
        start = time.perf_counter()
        thread.start()
        during: list[tuple[float, float]] = []
        while thread.is_alive():
            status, seconds, message = _short(url)
            assert status == 200, (status, message)
            during.append((time.perf_counter() - start, seconds))
        thread.join()
        long_end = done["at"] - start
        answered = [(t, s) for t, s in during if t < long_end]
        return {
            "short_alone_s_median": round(statistics.median(alone), 3),
            "short_alone_s_max": round(max(alone), 3),
            "long_status": done["status"], "long_message": done["message"][:160], "long_s": round(done["seconds"], 3),
            "short_answered_while_long_ran": len(answered),
            "short_during_s_median": round(statistics.median(s for _, s in answered), 3) if answered else None,
            "short_during_s_max": round(max(s for _, s in answered), 3) if answered else None,
        }
    finally:
        server.stop()


def main() -> None:
    parser = cli.parser(None, __doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=1600, help="tool calls (2 messages each, plus 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--out", type=cli.new_file)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="akv-offloop-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-qwen3", seed=3)
        config_path = model / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = TEMPLATE.read_text(encoding="utf-8")
        config_path.write_text(json.dumps(config))
        result: dict[str, Any] = {**results.header("bench/provenance_offloop.py"),
                                  "convert": run_convert(model, args.calls, args.repeats)}
        if not args.skip_http:
            result["http"] = run_http(model, work, args.calls, args.repeats)
    results.show(result, args.out)


if __name__ == "__main__":
    main()
