"""The serving-replay suite's report: AKV vs Standard (next to the goals) and vs Text Engineering at
equal concurrency, affinity vs round-robin routing in router mode, each method at its own best
concurrency, the markdown table and an SVG of throughput and P95 latency."""

from __future__ import annotations

from typing import Any

from bench.agent_replay import plots

GOALS = {"output_tok_per_s": 1.5, "latency_p95_s": 2.0}
"""AKV vs Standard at equal concurrency: output throughput at least 1.5x, P95 latency at least 2x lower."""


def ratios(rows: list[dict[str, Any]], against: str = "standard") -> list[dict[str, Any]]:
    """Per AKV row: AKV vs ``against`` (a text method) at the same concurrency (output and input
    throughput as AKV / it, P50/P95 latency and TTFT as it / AKV: above 1 is AKV better), next to the
    goals (which are AKV vs Standard's)."""
    bases = {r["concurrency"]: r for r in rows if r["method"] == against and r.get("requests")}
    out = []
    for row in rows:
        base = bases.get(row["concurrency"])
        if not row["method"].startswith("akv") or base is None or not row.get("requests"):
            continue
        entry = {"method": row["method"], "concurrency": row["concurrency"]}
        for key in ("output_tok_per_s", "input_tok_per_s"):
            entry[key] = row[key] / base[key] if row.get(key) and base.get(key) else None
        for key in ("latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s"):
            entry[key] = base[key] / row[key] if row.get(key) and base.get(key) else None
        entry["meets_output_goal"] = entry["output_tok_per_s"] is not None and \
            entry["output_tok_per_s"] >= GOALS["output_tok_per_s"]
        entry["meets_p95_goal"] = entry["latency_p95_s"] is not None and \
            entry["latency_p95_s"] >= GOALS["latency_p95_s"]
        out.append(entry)
    return out


ROUTER_GOALS = {"read_fraction": 2.0, "latency_p95_s": 1.0}
"""Affinity vs round-robin at equal concurrency (issue #33): at least 2x the share of prompt tokens read
from the cache, and a better (lower) P95 latency."""


def router_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and concurrency measured through both routers: affinity vs round_robin (cached and
    read fractions and output throughput as affinity / round-robin, P50/P95 latency and TTFT P95 as
    round-robin / affinity: above 1 is affinity better), next to :data:`ROUTER_GOALS`."""
    by = {(r["method"], r["concurrency"], r.get("router")): r for r in rows if r.get("requests")}
    out = []
    for (method, level, router), mine in by.items():
        base = by.get((method, level, "round_robin"))
        if router != "affinity" or base is None:
            continue
        entry: dict[str, Any] = {"method": method, "concurrency": level}
        for key in ("cached_fraction", "read_fraction", "output_tok_per_s"):
            entry[key] = mine[key] / base[key] if mine.get(key) and base.get(key) else None
        for key in ("latency_p50_s", "latency_p95_s", "ttft_p95_s"):
            entry[key] = base[key] / mine[key] if mine.get(key) and base.get(key) else None
        entry["meets_read_goal"] = entry["read_fraction"] is not None and \
            entry["read_fraction"] >= ROUTER_GOALS["read_fraction"]
        entry["meets_p95_goal"] = entry["latency_p95_s"] is not None and \
            entry["latency_p95_s"] > ROUTER_GOALS["latency_p95_s"]
        out.append(entry)
    return out


def router_lines(entries: list[dict[str, Any]]) -> list[str]:
    """The markdown section of :func:`router_ratios`' entries."""
    lines = ["", "Affinity vs round-robin at equal concurrency (above 1: affinity better; goals: read from the cache "
             f">= {ROUTER_GOALS['read_fraction']}x, P95 latency better):", "",
             "| method | conc. | cached | read | output tok/s | P50 latency | P95 latency | TTFT P95 | read goal "
             "| P95 goal |", "|" + "---|" * 10]
    for q in entries:
        lines.append("| " + " | ".join([q["method"], str(q["concurrency"]), *(
            "-" if q[k] is None else f"{q[k]:.2f}x" for k in ("cached_fraction", "read_fraction", "output_tok_per_s",
                                                              "latency_p50_s", "latency_p95_s", "ttft_p95_s")),
            "met" if q["meets_read_goal"] else "not met", "met" if q["meets_p95_goal"] else "not met"]) + " |")
    return lines


def ratio_lines(entries: list[dict[str, Any]], goals: bool) -> list[str]:
    """Markdown rows of :func:`ratios`' entries, with the goal columns when ``goals``."""
    lines = []
    for q in entries:
        cells = [q["method"], str(q["concurrency"]), *(
            "-" if q[k] is None else f"{q[k]:.2f}x" for k in ("output_tok_per_s", "input_tok_per_s", "latency_p50_s",
                                                              "latency_p95_s", "ttft_p50_s", "ttft_p95_s"))]
        if goals:
            cells += ["met" if q["meets_output_goal"] else "not met", "met" if q["meets_p95_goal"] else "not met"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


STEADY_TURNS = 2
"""Measured requests per conversation below which a point is the first turns after priming (each
conversation's first measured turn may recover what priming the others evicted), not steady state."""


def short_windows(rows: list[dict[str, Any]]) -> list[str]:
    """A note per measured point whose window held fewer than :data:`STEADY_TURNS` requests per
    conversation."""
    out = []
    for r in rows:
        conversations = r.get("conversations") or r["concurrency"]
        if r.get("requests") and r["requests"] < STEADY_TURNS * conversations:
            out.append(f"{r['method']} c={r['concurrency']}: {r['requests']} requests for {conversations} "
                       f"conversations: the first turns after priming, not steady state")
    return out


def worker_split(row: dict[str, Any]) -> str:
    """The requests each worker behind the router served in the run, from the workers' own counters."""
    return "requests per worker " + "/".join("?" if n is None else str(n) for n in row["worker_requests"])


def best(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    """The method's row with the highest output throughput (its own best concurrency)."""
    got = [r for r in rows if r["method"] == method and r.get("output_tok_per_s")]
    return max(got, key=lambda r: r["output_tok_per_s"]) if got else None


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"`{result['command']}`", "", result["label"], "",
             "| method | server | conc. | requests | failed | summaries | output tok/s | input tok/s | cached | read "
             "| P50 s | P95 s | TTFT P50 s | TTFT P95 s | KV pool peak | KV tokens peak |",
             "|" + "---|" * 16]

    def cell(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    for r in rows:
        server = r["server"] + (f" ({worker_split(r)})" if r.get("worker_requests") else "")
        lines.append("| " + " | ".join([r["method"], server, str(r["concurrency"]), cell(r.get("requests")),
                                        cell(r.get("failed")), cell(r.get("summary_requests")),
                                        cell(r.get("output_tok_per_s"), 1), cell(r.get("input_tok_per_s"), 0),
                                        cell(r.get("cached_fraction")), cell(r.get("read_fraction")),
                                        cell(r.get("latency_p50_s")), cell(r.get("latency_p95_s")),
                                        cell(r.get("ttft_p50_s")), cell(r.get("ttft_p95_s")),
                                        cell(r.get("kv_token_usage_max")),
                                        cell(r.get("kv_used_tokens_max"), 0)]) + " |")
    if result.get("router_ratios"):
        lines += router_lines(result["router_ratios"])
    if result["ratios"] or not any(r.get("router") for r in rows):  # router mode has no Standard
        lines += ["", "AKV vs Standard at equal concurrency (above 1: AKV better; goals: output throughput >= "
                  f"{GOALS['output_tok_per_s']}x, P95 latency >= {GOALS['latency_p95_s']}x):", "",
                  "| method | conc. | output tok/s | input tok/s | P50 latency | P95 latency | TTFT P50 | TTFT P95 "
                  "| output goal | P95 goal |", "|" + "---|" * 10]
        lines += ratio_lines(result["ratios"], goals=True)
    if result.get("ratios_text_engineering"):
        lines += ["", "AKV vs Text Engineering at equal concurrency (above 1: AKV better):", "",
                  "| method | conc. | output tok/s | input tok/s | P50 latency | P95 latency | TTFT P50 | TTFT P95 |",
                  "|" + "---|" * 8]
        lines += ratio_lines(result["ratios_text_engineering"], goals=False)
    timed = [r for r in rows if r.get("akv_per_request")]
    if timed:
        lines += ["", "AKV server time per context request, ms (means over each run from the patched server's "
                  "counters; requests overlap at concurrency above 1):", "",
                  "| method | conc. | context requests | admission | wait | rounds | forward | copy | host "
                  "| forwards |",
                  "|" + "---|" * 10]
        for r in timed:
            t = r["akv_per_request"]
            lines.append("| " + " | ".join([r["method"], str(r["concurrency"]), str(r["akv_context_requests"]),
                                            *(f"{t[k]:.1f}" for k in ("admission_ms", "wait_ms", "rounds_ms",
                                                                       "forward_ms", "copy_ms", "host_ms")),
                                            f"{t['forwards']:.2f}"]) + " |")
    own = result.get("best")
    if own:
        lines += ["", "Each method at its own best concurrency (highest output throughput): " + "; ".join(
            f"{m} c={r['concurrency']} {r['output_tok_per_s']:.1f} tok/s, P95 {r['latency_p95_s'] or 0:.2f} s"
            for m, r in own.items() if r)]
    started = [f"{name} ready in {info['startup_s']:.0f} s" for name, info in result.get("servers", {}).items()
               if "startup_s" in info]
    if started:
        lines += ["", "Servers: " + "; ".join(started) + (f"; suite {result['total_s']:.0f} s in all"
                                                          if "total_s" in result else "") + "."]
    short = short_windows(rows)
    if short or result.get("notes"):
        lines += ["", *[f"- {n}" for n in [*short, *result.get("notes", [])]]]
    return "\n".join(lines) + "\n"


def svg(rows: list[dict[str, Any]], levels: list[int]) -> str:
    """Output throughput and P95 latency per method, by position in the concurrency sweep."""
    def name(r: dict[str, Any]) -> str:
        return f"{r['method']} ({r['router']})" if r.get("router") else r["method"]

    methods = list(dict.fromkeys(map(name, rows)))

    def series(key: str) -> dict[str, list[float | None]]:
        by = {(name(r), r["concurrency"]): r.get(key) for r in rows}
        return {m: [by.get((m, c)) for c in levels] for m in methods}

    label = "concurrency " + ", ".join(str(c) for c in levels) + " (by position)"
    return plots.line_panels([("output tokens/s", series("output_tok_per_s")),
                              ("P95 request latency, s", series("latency_p95_s"))], label)
