"""KV pool usage during a replay run, sampled from SGLang's Prometheus endpoint (`GET /metrics`,
served with `--enable-metrics`): the fraction of the pool in use and the tokens it holds."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

GAUGES = {"sglang:token_usage": "token_usage", "sglang:num_used_tokens": "used_tokens",
          "sglang:max_total_num_tokens": "pool_tokens"}


def parse_gauges(text: str) -> dict[str, float]:
    """The GAUGES found in a Prometheus text page (the first sample of each, labels ignored)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        key = GAUGES.get(head.split("{", 1)[0])
        if key is None or key in out:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


@dataclass
class PoolMonitor:
    """Polls `url`/metrics every `interval_s` seconds between start() and stop(); `summary()` gives
    the peak and mean of each gauge, or None where the server exposes no metrics."""

    url: str
    interval_s: float = 0.5
    samples: list[dict[str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll(self) -> dict[str, float] | None:
        try:
            with urllib.request.urlopen(self.url.rstrip("/") + "/metrics", timeout=5) as response:
                return parse_gauges(response.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def start(self) -> PoolMonitor:
        def loop() -> None:
            while True:
                got = self.poll()
                if got:
                    self.samples.append(got)
                if self._stop.wait(self.interval_s):
                    return

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any] | None:
        if not self.samples:
            return None
        out: dict[str, Any] = {"kv_samples": len(self.samples)}
        for key in GAUGES.values():
            values = [s[key] for s in self.samples if key in s]
            if values:
                out[f"kv_{key}_max"] = max(values)
                out[f"kv_{key}_mean"] = sum(values) / len(values)
        return out

