"""The comparison with the exact reference server that the device checks share: an agent's
record-chain conversation (plain turns, then turns with ``drop_message``/``reposition``, a plain
probe after each), each request's served log-probs and usage against the reference's, and the
verdict: context requests within 1.5x the plain requests' largest error, greedy tokens equal wherever
the reference's top-2 margin exceeds that bound, usage equal."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import client

RATIO = 1.5


def call(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "read_record", "arguments": json.dumps({"id": f"R-{i}"})}}]}


def result(i: int, words: int) -> dict[str, Any]:
    body = " ".join(f"field{j}=value{(i * 31 + j) % 97}" for j in range(words))
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": f"record R-{i}: {body}; next R-{i + 1}"}


DEFAULT_WORDS = tuple(40 + 13 * turn for turn in range(8))
WINDOW_WORDS = (30, 30, 3, 3, 30, 3, 3, 30)
"""Tool results of ~130 or ~25 tokens (bench/akv_models_check.py): with a 128-token sliding window
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
        body: dict[str, Any] = {"messages": list(history), "tools": client.TOOLS}
        if drops or repositions:
            body["drop_message"] = {k: list(v) for k, v in drops.items()}
            if repositions:
                body["reposition"] = list(repositions)
            out.append((f"context-turn-{turn}", body))
        else:
            out.append((f"plain-turn-{turn}", body))
        out.append((f"plain-probe-{turn}", {"messages": list(history)[:-1] + [
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"probe {turn}"}], "tools": client.TOOLS}))
    return out


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
        rows[name] = compare(client.chat(url, body), client.chat(reference_url, body),
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


@contextmanager
def reference_server(model: Path, **engine: Any) -> Iterator[Any]:
    """The exact reference server (``akv.system.reference_server``, FP32) on ``model`` serving from a
    thread while the block runs; ``engine`` goes to its ``Engine`` (``kv_slots``, ``device``, ...)."""
    from akv.system.reference_server import Engine, ReferenceServer  # here: --help needs no torch

    server = ReferenceServer(Engine(model, name="default", **engine))
    server.start_in_background()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
