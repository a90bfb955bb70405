"""CPU triage for akv_models_check.py's MiniMax part: MoE router near-ties at the scored tokens.

Where the exact reference's router is close to a tie at a token whose log-probs are compared (the
last prompt token, then each decode step), bf16 arithmetic on the GPU may choose the other expert,
and that token's log-probs move far beyond bf16 noise: in plain and context requests alike, with
nothing wrong in the cache. For each request of ``bench.harness.oracle.requests(WINDOW_WORDS)``, served in
order on one reference engine as the check serves them: per generated token the smallest gap, over
layers, between the k-th and (k+1)-th biased router score of that token. For a first token whose gap
is below ``--below``: its log-probs with that expert swapped for the next (the request rerun on an
empty cache, where the reference computes the same logits), and the error the check would then show.

    python bench/router_ties.py [--model DIR] [--tokens 8] [--below 0.005] [--out FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from akv.system.reference.minimax_m2 import MiniMaxM2Model  # noqa: E402
from akv.system.reference_server import Engine  # noqa: E402
from akv.system.reference_server.protocol import parse_chat_request  # noqa: E402
from bench.harness import oracle, results  # noqa: E402


class RouterProbe:
    """Wraps a MiniMax reference model's ``route``: records each call's layer and the gap between the
    k-th and (k+1)-th biased score of its last row; at call ``swap_at`` that row's k-th expert is
    replaced by the (k+1)-th (weights renormalised as ``route`` does)."""

    def __init__(self, model: MiniMaxM2Model) -> None:
        if not isinstance(model, MiniMaxM2Model):
            raise ValueError(f"model: a {type(model).__name__}; the probe reads MiniMax-M2's sigmoid router")
        self.model, self._route = model, model.route
        self.calls: list[tuple[int, float]] = []
        self.swap_at: int | None = None
        model.route = self.route

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.model.config.top_k
        scores, biased = self.model.routing_scores(layer, x)
        top = torch.topk(biased[-1], k + 1)
        index = len(self.calls)
        self.calls.append((layer, float(top.values[k - 1] - top.values[k])))
        chosen, weights = self._route(layer, x)
        if index == self.swap_at:
            chosen = chosen.clone()
            chosen[-1, k - 1] = top.indices[k]
            picked = scores.gather(1, chosen)
            weights = (picked / picked.sum(dim=-1, keepdim=True)).to(weights.dtype)
        return chosen, weights


def generate(engine: Engine, body: dict[str, Any], tokens: int) -> list[Any]:
    """The reference's token steps for ``body`` (greedy, as the checks ask: bench.harness.client.chat)."""
    request = parse_chat_request({"model": "default", "max_tokens": tokens, "temperature": 0.0, "logprobs": True,
                                  "top_logprobs": 2, **body}, "default", engine.content_format)
    return list(engine.generate(engine.prepare(request), request, None).steps)


def token_gaps(calls: list[tuple[int, float]], n_tokens: int, n_layers: int) -> list[list[float]]:
    """Per generated token, the gap of each layer: the last ``n_layers`` calls of the prefill score the
    first token, each decode forward (``n_layers`` calls) the next."""
    tail = calls[len(calls) - n_tokens * n_layers:]
    return [[gap for _, gap in tail[i * n_layers:(i + 1) * n_layers]] for i in range(n_tokens)]


def swapped_first_token(engine: Engine, probe: RouterProbe, body: dict[str, Any], layer: int) -> dict[str, float]:
    """First-token log-probs (top two) with the last prompt token's k-th expert at ``layer`` swapped."""
    engine.cache.flush()
    probe.calls, probe.swap_at = [], None
    generate(engine, body, 1)
    last_forward = len(probe.calls) - probe.model.config.num_layers
    engine.cache.flush()
    probe.calls, probe.swap_at = [], last_forward + layer
    step = generate(engine, body, 1)[0]
    engine.cache.flush()
    probe.swap_at = None
    return {c.text: c.logprob for c in step.top[:2]}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="model folder (default: minimax-m2-tiny, bf16, seed 0, made in build/akv-router-ties)")
    p.add_argument("--tokens", type=int, default=8, help="tokens generated per request (the check's max_tokens)")
    p.add_argument("--below", type=float, default=0.005, help="first-token gaps below this are swapped")
    p.add_argument("--out", type=cli.new_file, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if args.model is None:
        from akv.system.models.minimax_m2 import make_minimax_m2_tiny

        args.model = make_minimax_m2_tiny(ROOT / "build" / "akv-router-ties" / "minimax-m2-tiny", dtype="bfloat16", seed=0)
    serving, cold = Engine(args.model, name="default"), Engine(args.model, name="default")
    probe, cold_probe = RouterProbe(serving.model), RouterProbe(cold.model)
    n_layers = serving.model.config.num_layers
    rows = {}
    for name, body in oracle.requests(oracle.WINDOW_WORDS):
        probe.calls = []
        steps = generate(serving, body, args.tokens)
        gaps = token_gaps(probe.calls, len(steps), n_layers)
        first = sorted((c.logprob for c in steps[0].top), reverse=True)
        row: dict[str, Any] = {"first_token": steps[0].chosen.text, "first_logprob": steps[0].chosen.logprob,
                               "first_margin": first[0] - first[1], "gaps": gaps,
                               "min_gap_per_token": [min(g) for g in gaps]}
        swaps = {}
        for layer, gap in enumerate(gaps[0]):
            if gap < args.below:
                top = swapped_first_token(cold, cold_probe, body, layer)
                best = max(top, key=top.get)
                swaps[layer] = {"gap": gap, "top": top,
                                "error_if_served": abs(top[best] - steps[0].chosen.logprob)}
        row["first_token_swaps"] = swaps
        rows[name] = row
        print(f"{name:16s} first {row['first_token']!r} lp {row['first_logprob']:.4f} margin {row['first_margin']:.3f} "
              f"min gap per token {' '.join(f'{g:.4f}' for g in row['min_gap_per_token'])}"
              + "".join(f"\n    layer {layer} gap {s['gap']:.5f}: swapped top {s['top']}, first-token error "
                        f"{s['error_if_served']:.4f} if served" for layer, s in swaps.items()), flush=True)
    if args.out is not None:
        results.write({**results.header("bench/router_ties.py", argv), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
