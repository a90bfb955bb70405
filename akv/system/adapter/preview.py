"""Dry run on the patched SGLang: ``akv_dry_run: true`` on chat completions and the ``akv`` block of
``/v1/messages/count_tokens``. The HTTP side sends the converted request (prompt ids, compiled
program) to the scheduler on SGLang's internal-state control path; the scheduler matches and plans
it against the cache core as admission would (no lock, no allocation, no tree change) and answers
with the usage serving it would report now."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from akv.system.adapter import lengths
from akv.system.adapter.anthropic import count_tokens as token_counts
from akv.system.adapter.request_checks import RequestFieldError
from akv.system.adapter.scheduling import ADMISSION_SLACK, attach
from akv.system.adapter.serving import UnsupportedContextRequest, convert_request
from akv.system.cache import plain
from akv.system.cache.plan import Usage

FIELD = "akv_dry_run"
ERROR = "error"


def requested(request: Any) -> bool:
    """Whether a chat completion asks for a dry run (``akv_dry_run`` must be true or false)."""
    value = getattr(request, FIELD, None)
    if value is None or value is False:
        return False
    if value is not True:
        raise RequestFieldError(FIELD, f"{value!r}: expected true or false")
    return True


async def usage(tokenizer_manager: Any, adapted_request: Any) -> dict[str, int]:
    """What serving ``adapted_request`` (a converted ``GenerateReqInput``) would read from the cache,
    re-rotate, compute and drop: ``prompt_tokens`` and the four counters of
    :class:`akv.system.cache.plan.Usage`. A request the scheduler would refuse raises ``ValueError``
    naming the field (HTTP 400)."""
    from sglang.srt.managers.io_struct import GetInternalStateReq

    ids = adapted_request.input_ids
    if not isinstance(ids, list) or (ids and not isinstance(ids[0], int)):
        raise RequestFieldError("messages", "a dry run needs one text prompt")
    sampling = adapted_request.sampling_params or {}
    extra_key = adapted_request.extra_key
    query = {"input_ids": [int(t) for t in ids], "program": lengths.wire_bytes(adapted_request.context_program),
             "extra_key": extra_key if isinstance(extra_key, str) else "",
             "max_new_tokens": sampling.get("max_new_tokens")}
    tokenizer_manager.auto_create_handle_loop()
    replies = await tokenizer_manager.get_internal_state_communicator(GetInternalStateReq(akv_preview=query))
    answer = replies[0].internal_state
    if ERROR in answer:
        raise UnsupportedContextRequest(answer[ERROR], answer[ERROR].split(":", 1)[0])
    return answer


async def count_tokens(serving_chat: Any, anthropic_request: Any, chat_request: Any,
                       raw_request: Any) -> dict[str, Any]:
    """The count_tokens body: ``chat_request`` (with the edits' drop fields) converted as
    `/v1/messages` would serve it, its input tokens before and after the edits
    (:func:`akv.system.adapter.anthropic.count_tokens`) and, for a text prompt, the dry run's
    counters under ``akv`` (with ``prompt_tokens``, as the reference server's)."""
    adapted, _ = await convert_request(serving_chat, chat_request, raw_request)
    ids = adapted.input_ids
    if not isinstance(ids, list) or (ids and not isinstance(ids[0], int)):
        text = ids if isinstance(ids, str) else adapted.text
        return token_counts(anthropic_request, len(serving_chat.tokenizer_manager.tokenizer.encode(text)))
    counters = await usage(serving_chat.tokenizer_manager, adapted)
    return {**token_counts(anthropic_request, counters["prompt_tokens"]), "akv": counters}


def chat_body(request: Any, counters: dict[str, int]) -> dict[str, Any]:
    """The chat-completions dry-run response (the reference server's shape)."""
    prompt = counters["prompt_tokens"]
    details = {key: value for key, value in counters.items() if key != "prompt_tokens"}
    return {"object": "akv.dry_run", "model": request.model,
            "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
                      "prompt_tokens_details": details}}


def plan(scheduler: Any, query: dict[str, Any]) -> dict[str, Any]:
    """Scheduler side: the usage of ``query`` planned against the cache as it is now, or
    ``{"error": ...}`` with the message admission would refuse it with. Takes nothing."""
    ids = np.asarray(query["input_ids"], dtype=np.int64)
    core = getattr(scheduler.tree_cache, "core", None)
    if core is None:
        return {ERROR: "radix_cache_backend: a dry run needs the AKV cache "
                       "(start with python -m akv.system.launch_server)"}
    extra_key = query["extra_key"] or ""
    if query["program"] is None:  # a plain request: SGLang computes at least its last token
        resident = plain.resident_prefix(core, ids, extra_key).size
        cached = min(int(resident), max(ids.size - 1, 0))
        counts = Usage(cached, 0, 0, int(ids.size) - cached)
    else:
        req = SimpleNamespace(origin_input_ids=ids.tolist(), extra_key=extra_key, akv=None,
                              sampling_params=SimpleNamespace(max_new_tokens=query["max_new_tokens"]))
        error = attach(req, SimpleNamespace(context_program=query["program"]), scheduler.server_args,
                       scheduler.max_total_num_tokens, scheduler.model_config.context_len)
        if error is not None:
            return {ERROR: error}
        from sglang.srt.environ import envs

        room = core.pool.size - req.sampling_params.max_new_tokens - ADMISSION_SLACK
        draft = req.akv.plan_draft(core, cold=bool(envs.SGLANG_RADIX_FORCE_MISS.get()), room=room)
        counts = draft.plan.plan.usage
    return {"prompt_tokens": int(ids.size), **counts.as_dict()}
