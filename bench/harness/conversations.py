"""The synthetic agent conversation the 8B-shaped checks and benchmarks send: a record chain whose
tool results have a set number of tokens, the same text for the same seed."""

from __future__ import annotations

import json
from typing import Any


class Conversation:
    """A record-chain agent conversation whose tool results have about ``result_tokens`` tokens."""

    def __init__(self, tokenizer: Any, seed: int, result_tokens: int) -> None:
        self.tokenizer, self.seed, self.result_tokens = tokenizer, seed, result_tokens
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"Run {seed}: follow chains of records with read_record."},
            {"role": "user", "content": f"Start at record {seed}-0 and follow the chain to its end."}]

    def _text(self, i: int, n_tokens: int) -> str:
        words, text = [], ""
        while len(self.tokenizer(text).input_ids) < n_tokens:
            words.extend(f"r{self.seed}x{i}w{j} v{(j * 7919 + i) % 1000}" for j in range(len(words), len(words) + 50))
            text = " ".join(words)
        return text

    def step(self, n_tokens: int | None = None) -> None:
        i = len(self.messages) // 2
        call_id = f"call_{self.seed}_{i}"
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                              "function": {"name": "read_record", "arguments": json.dumps({"id": f"{self.seed}-{i}"})}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": self._text(i, n_tokens or self.result_tokens)})
