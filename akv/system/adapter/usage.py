"""Usage counters of context requests: from the plan (scheduler side) into
``usage.prompt_tokens_details`` of streamed and non-streamed responses (HTTP side).

They travel in SGLang's per-request ``cached_tokens_details`` dict, which already reaches each
response's ``meta_info``; for context requests they are reported whatever ``--enable-cache-report`` says.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KEYS = ("cached_tokens", "repos_tokens", "drop_skipped_tokens", "computed_tokens")


def is_context(req: Any) -> bool:
    """Whether ``req`` is a context request (on a PD decode server too)."""
    return getattr(req, "akv", None) is not None or getattr(req, "akv_pd", None) is not None


def cached_tokens_details(req: Any) -> dict[str, int] | None:
    """The details dict of a context request (None for a plain one, or one never admitted); on a PD
    decode server, the usage the prefill server sent (None until its KV arrived)."""
    state, pd = getattr(req, "akv", None), getattr(req, "akv_pd", None)
    found = state.first_usage if state is not None else None if pd is None else pd.usage
    if found is None:
        return None
    usage = found.as_dict()
    return {"device": usage["cached_tokens"], "host": 0, **usage}


def prompt_tokens(req: Any) -> int:
    """The prompt's length in tokens as a response reports it: on a PD decode server a context
    request's text (its ``origin_input_ids`` there are the kept tokens)."""
    pd = getattr(req, "akv_pd", None)
    return len(req.origin_input_ids) if pd is None else pd.prompt_tokens


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
