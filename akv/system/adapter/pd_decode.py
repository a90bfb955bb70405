"""The decode server of a PD pair (``--disaggregation-mode decode``): a context request as SGLang's
decode path holds it.

The decode server compiles the same program from the same body (the router sends it to both). SGLang's
decode path sizes everything by the prompt: the slots it allocates before the transfer, the indices it
sends the prefill server, the sequence length of each step. A context request's prompt there is its
kept tokens (``origin_input_ids`` becomes them), so all of that counts ``V`` columns, which receive the
prefill server's send list in order (:mod:`akv.system.adapter.disaggregation`). Positions are the one
thing SGLang's count gets wrong: its decode step's position is ``seq_len - 1``, a column, and after a
Drop without a Repos the program's next position is not ``V``; each step adds the request's offset.
The prompt's length as reported and the usage counters come from the program and the metadata row.
"""

from __future__ import annotations

from array import array
from http import HTTPStatus
from typing import Any

import numpy as np
import torch

from akv.system.adapter import lengths
from akv.system.adapter.device import to_device
from akv.system.adapter.disaggregation import DecodeLayout, PdMetadata, check_received
from akv.system.cache.plan import Usage


class PdDecodeRequest:
    """A context request on the decode server (held as ``Req.akv_pd``): its layout, its prompt's
    length in tokens, and the usage the prefill server reported (None until the KV arrived)."""

    def __init__(self, layout: DecodeLayout, prompt_tokens: int) -> None:
        self.layout = layout
        self.prompt_tokens = prompt_tokens
        self.usage: Usage | None = None


def attach(req: Any, data: bytes, server_args: Any, context_len: int | None) -> str | None:
    """Give ``req`` its decode-side state from the tokenized request's program; an error message
    (HTTP 400) when the program is malformed, does not fit ``context_len``, or the server keeps a
    decode-side radix cache (which would offer the kept tokens' KV to plain requests as their prefix)."""
    if server_args.disaggregation_decode_enable_radix_cache:
        return ("server configuration: drop_message/reposition are not served with "
                "--disaggregation-decode-enable-radix-cache (disaggregation_decode_enable_radix_cache)")
    program = lengths.request_program(req, data, context_len)
    if isinstance(program, str):
        return program
    req.akv_pd = PdDecodeRequest(DecodeLayout.of(program), len(req.origin_input_ids))
    req.origin_input_ids = array("q", program.token_ids[program.keep].tolist())
    return None


def commit(scheduler: Any, req: Any, row: Any) -> None:
    """After the transfer (SGLang's ``_commit_transfer_to_req``): take the usage from the metadata
    ``row``, or abort ``req`` (SGLang then releases its slots) when what arrived is not this
    program's or the model keeps per-request state the send list does not carry."""
    state: PdDecodeRequest | None = getattr(req, "akv_pd", None)
    if state is None:
        return
    from sglang.srt.disaggregation.utils import prepare_abort

    received = PdMetadata.read(row)
    problem = check_received(state.layout, received)
    if problem is None and (scheduler.sliding_window_size or scheduler.disagg_decode_prealloc_queue.kv_manager
                            .kv_args.state_types):
        problem = ("server configuration: drop_message/reposition on a PD pair need a model without "
                   "sliding-window or recurrent layers (disaggregation_mode)")
    if problem is not None:
        prepare_abort(req, problem, status_code=HTTPStatus.BAD_REQUEST)
        return
    state.usage = received.usage
    req.cached_tokens = received.usage.cached_tokens


def decode_positions(batch: Any, positions: torch.Tensor) -> torch.Tensor:
    """A decode step's positions: SGLang's ``seq_len - 1`` (the new token's column) plus each context
    request's offset ``next_position - V``."""
    offsets = [0 if r.akv_pd is None else r.akv_pd.layout.offset for r in batch.reqs]
    if not any(offsets):
        return positions
    return positions + to_device(np.asarray(offsets, dtype=np.int64), positions.device, positions.dtype)
