"""Usage counters of context requests: from the plan (scheduler side) into
``usage.prompt_tokens_details`` of streamed and non-streamed responses (HTTP side).

They travel in SGLang's per-request ``cached_tokens_details`` dict, which already reaches each
response's ``meta_info``; for context requests they are reported whatever ``--enable-cache-report`` says.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KEYS = ("cached_tokens", "repos_tokens", "drop_skipped_tokens", "computed_tokens")


def cached_tokens_details(req: Any) -> dict[str, int] | None:
    """The details dict of a context request (None for a plain one, or one never admitted)."""
    state = getattr(req, "akv", None)
    if state is None or state.first_usage is None:
        return None
    usage = state.first_usage.as_dict()
    return {"device": usage["cached_tokens"], "host": 0, **usage}


def apply(usage: Any, details: Iterable[Any]) -> Any:
    """``usage`` with the AKV counters summed over the responses that carry them."""
    found = [d for d in details if isinstance(d, dict) and "drop_skipped_tokens" in d]
    if not found or usage is None:
        return usage
    from sglang.srt.entrypoints.openai.protocol import PromptTokensDetails

    totals = {key: sum(int(d[key]) for d in found) for key in KEYS}
    current = usage.prompt_tokens_details
    extra = {} if current is None else {k: getattr(current, k) for k in ("image_tokens", "audio_tokens", "video_tokens")}
    usage.prompt_tokens_details = PromptTokensDetails(**totals, **extra)
    return usage
