"""On the H200, with the patched server up on the tiny random Qwen3 (``SGLANG_BASE_URL``, bf16):
the same chat requests, plain and with ``drop_message``/``reposition``, go to it and to the exact
CPU reference server (FP32, the oracle's arithmetic) started here on the same weights.

Per request: the served token log-probs against the reference's (until the first differing token),
the reference's top-2 margin wherever the tokens differ, and the usage. SGLang's CUDA RMSNorm has
no FP32 path, so the bound is measured, not assumed: context requests must stay within 1.5x the
largest error of the plain requests in the same run, greedy tokens must agree wherever the
reference's top-2 margin exceeds that error, and usage must equal the reference server's.

Writes ``$AKV_BENCH_OUT/akv_served_check.json``; exits 1 if a check fails. Each environment variable
has a flag instead (``--help``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from akv import cli

RATIO = 1.5
TOOLS = [{"type": "function", "function": {"name": "read_record", "description": "Read one record",
                                          "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                                                         "required": ["id"]}}}]


def call(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "read_record", "arguments": json.dumps({"id": f"R-{i}"})}}]}


def result(i: int, words: int) -> dict[str, Any]:
    body = " ".join(f"field{j}=value{(i * 31 + j) % 97}" for j in range(words))
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": f"record R-{i}: {body}; next R-{i + 1}"}


DEFAULT_WORDS = tuple(40 + 13 * turn for turn in range(8))
WINDOW_WORDS = (30, 30, 3, 3, 30, 3, 3, 30)
"""Tool results of ~130 or ~25 tokens (tools/gpu/akv_models_check.py): with a 128-token sliding window
the drops of turns 3 and 6 lie inside the generation prompt's window, the others outside it."""


def requests(words: Sequence[int] = DEFAULT_WORDS) -> list[tuple[str, dict[str, Any]]]:
    """(name, body) in serving order: an agent's turns (turn t's tool result has ``words[t]``
    fields), plain first, then with cache operations: from turn 2 each turn drops the result of two
    turns before, from turn 3 every odd turn repositions after the drops; a probe after each turn."""
    system = {"role": "system", "content": "You follow chains of records with the read_record tool."}
    task = {"role": "user", "content": "Start at R-0 and follow the chain to its end."}
    history = [system, task]
    out: list[tuple[str, dict[str, Any]]] = []
    drops: dict[str, list[int]] = {}
    repositions: list[int] = []
    for turn, n_words in enumerate(words):
        history = history + [call(turn), result(turn, n_words)]
        anchor = len(history) - 1
        if turn >= 2:
            drops[str(anchor)] = [anchor - 4]
        if turn >= 3 and turn % 2 == 1:
            repositions.append(anchor)
        body: dict[str, Any] = {"messages": list(history), "tools": TOOLS}
        if drops or repositions:
            body["drop_message"] = {k: list(v) for k, v in drops.items()}
            if repositions:
                body["reposition"] = list(repositions)
            out.append((f"context-turn-{turn}", body))
        else:
            out.append((f"plain-turn-{turn}", body))
        out.append((f"plain-probe-{turn}", {"messages": list(history)[:-1] + [
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"probe {turn}"}], "tools": TOOLS}))
    return out


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    full = {"model": "default", "max_tokens": 8, "temperature": 0.0, "logprobs": True, "top_logprobs": 2, **body}
    return cli.request_json(f"{url}/v1/chat/completions", full, timeout=300)


def compare(got: dict[str, Any], want: dict[str, Any], tokens: int | None = None) -> dict[str, Any]:
    """Log-prob error over the common prefix of the first ``tokens`` (default all) generated tokens,
    and at the first differing token the reference's margin and both tokens (None when all agree)."""
    mine = got["choices"][0]["logprobs"]["content"][:tokens]
    ref = want["choices"][0]["logprobs"]["content"][:tokens]
    error, margin_at_split, split_tokens, agree = 0.0, None, None, 0
    for a, b in zip(mine, ref):
        error = max(error, abs(a["logprob"] - b["logprob"]))
        if a["token"] != b["token"]:
            top = sorted((t["logprob"] for t in b["top_logprobs"]), reverse=True)
            margin_at_split = top[0] - top[1] if len(top) > 1 else float("inf")
            split_tokens = {"served": a["token"], "reference": b["token"]}
            break
        agree += 1
    first = abs(mine[0]["logprob"] - ref[0]["logprob"]) if mine and ref else None
    return {"error": error, "first_token_error": first, "agree": agree, "n": len(ref),
            "margin_at_split": margin_at_split, "split_tokens": split_tokens, "usage": got["usage"],
            "reference_usage": want["usage"]}


def serve_pairs(url: str, reference_url: str, bodies: list[tuple[str, dict[str, Any]]],
                log: Callable[[str], None] = print, plain_tokens: int | None = None) -> dict[str, dict[str, Any]]:
    """Each request to the server under test and to the reference; a row of :func:`compare` per name
    (plain requests compared on their first ``plain_tokens`` tokens only, where given)."""
    rows = {}
    for name, body in bodies:
        rows[name] = compare(post(url, body), post(reference_url, body),
                             plain_tokens if name.startswith("plain") else None)
        log(f"{name}: {rows[name]['error']:.3f} agree {rows[name]['agree']}/{rows[name]['n']}")
    return rows


def verdict(rows: dict[str, dict[str, Any]], floor: float = 0.0, same_cache: bool = True,
            first_token_bound: bool = False) -> dict[str, Any]:
    """The plain requests' largest log-prob error, the bound it sets for the rest (never below
    ``floor``: a CPU dry run in FP32 has noise-level errors only), and every failure. Without
    ``same_cache`` (the server under test served other traffic and evicted in between) only the
    counts that do not depend on what is resident must agree: prompt and drop-skipped tokens. With
    ``first_token_bound`` (plain requests compared on their first token only) the bound is set by and
    applies to first-token errors; tokens are still compared wherever both were."""
    error = "first_token_error" if first_token_bound else "error"
    plain_error = max(r[error] for n, r in rows.items() if n.startswith("plain") and r[error] is not None)
    bound = max(RATIO * plain_error, floor)
    failures = []
    for name, row in rows.items():
        if name.startswith("context") and row[error] is not None and row[error] > bound:
            failures.append(f"{name}: log-prob error {row[error]:.3f} > {RATIO} x plain {plain_error:.3f}")
        if row["margin_at_split"] is not None and row["margin_at_split"] > bound:
            failures.append(f"{name}: tokens differ where the reference's margin {row['margin_at_split']:.3f} > {bound:.3f}")
        got = row["usage"].get("prompt_tokens_details")
        want = row["reference_usage"].get("prompt_tokens_details")
        if not same_cache and got is not None and want is not None:
            got, want = got.get("drop_skipped_tokens"), want.get("drop_skipped_tokens")
        if name.startswith("context") and got != want:
            failures.append(f"{name}: usage {got} != reference {want}")
        if row["usage"]["prompt_tokens"] != row["reference_usage"]["prompt_tokens"]:
            failures.append(f"{name}: prompt_tokens differ")
    return {"plain_max_logprob_error": plain_error, "bound": bound, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(None, __doc__.split("\n\n")[0])
    env = os.environ.get
    parser.add_argument("--base-url", default=env("SGLANG_BASE_URL"), required=env("SGLANG_BASE_URL") is None,
                        help="the patched server under test (default: $SGLANG_BASE_URL)")
    parser.add_argument("--model", type=Path, default=env("AKV_TINY_MODEL"), required=env("AKV_TINY_MODEL") is None,
                        help="the tiny model's folder, for the reference server (default: $AKV_TINY_MODEL)")
    parser.add_argument("--out-dir", type=Path, default=Path(env("AKV_BENCH_OUT", ".")),
                        help="folder for akv_served_check.json (default: $AKV_BENCH_OUT, else .)")
    args = parser.parse_args(argv)
    url, model, out_dir = args.base_url, Path(args.model), args.out_dir
    if (out_dir / "akv_served_check.json").exists():
        parser.error(f"{out_dir / 'akv_served_check.json'} exists; results are never replaced")
    from akv.system.reference_server import Engine, ReferenceServer  # here: --help needs no torch

    reference = ReferenceServer(Engine(model, name="default", kv_slots=16384))
    reference.start_in_background()
    started = time.time()
    try:
        rows = serve_pairs(url, reference.url, requests(), lambda line: print(line, flush=True))
    finally:
        reference.shutdown()
        reference.server_close()
    result = verdict(rows)
    report = {"command": "tools/gpu/akv_served_check.py (run by tools/gpu/run.sh with AKV_BENCH_LIVE)",
              **result, "requests": rows, "seconds": round(time.time() - started, 1)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "akv_served_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
