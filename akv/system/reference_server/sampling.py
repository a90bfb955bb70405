"""Pick the next token from logits: greedy at temperature 0, else temperature + nucleus sampling."""

from __future__ import annotations

import torch

from akv.system.reference_server.protocol import Sampling


class Sampler:
    """Stateful per request (the random generator advances with each sampled token)."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self._generator: torch.Generator | None = None
        if sampling.temperature > 0:
            self._generator = torch.Generator()
            if sampling.seed is not None:
                self._generator.manual_seed(sampling.seed)
            else:
                self._generator.seed()

    def pick(self, logits: torch.Tensor) -> int:
        """Token id for one ``[vocab]`` float32 logits row (ties break to the lowest id when greedy)."""
        if self._generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.to(torch.float64) / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs[before >= self.sampling.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator))
