"""Helpers for the OpenAI Python SDK: AKV fields go through `extra_body=`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from akv.agent.errors import HistoryError, PayloadError
from akv.agent.history import CacheOperationHistory
from akv.agent.payload import akv_fields


def extra_body(history: CacheOperationHistory, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The AKV fields of `history`, merged over `base`, ready for
    `client.chat.completions.create(..., extra_body=extra_body(history))`."""
    if not isinstance(history, CacheOperationHistory):
        raise HistoryError(f"extra_body: history must be a CacheOperationHistory, got {type(history).__name__}")
    if base is not None and not isinstance(base, Mapping):
        raise PayloadError(f"extra_body: base must be a mapping or None, got {type(base).__name__}", field="extra_body")
    return {**(base or {}), **akv_fields(history)}
