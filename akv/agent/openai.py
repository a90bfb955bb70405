"""Helpers for the OpenAI Python SDK: AKV fields go through `extra_body=`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from akv.agent.history import CacheOperationHistory
from akv.agent.payload import akv_fields


def extra_body(history: CacheOperationHistory, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The AKV fields of `history`, merged over `base`, ready for
    `client.chat.completions.create(..., extra_body=extra_body(history))`."""
    if not isinstance(history, CacheOperationHistory):
        raise TypeError(f"extra_body needs a CacheOperationHistory, got {type(history).__name__}")
    return {**(base or {}), **akv_fields(history)}
