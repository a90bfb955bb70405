"""Checks on the incoming chat payload and the copy that carries the AKV fields out."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from akv.agent.errors import PayloadError
from akv.agent.history import CacheOperationHistory
from akv.agent.jsonvalue import MAX_DEPTH
from akv.agent.thinking import thinking_rule

API_STYLES = ("sglang", "openai")
AKV_FIELDS = ("drop_message", "reposition", "drop_rule")


def check_payload(payload: object, api_style: str) -> None:
    """Reject payloads the policy cannot extend: not an object, AKV fields already present, an
    un-merged `extra_body` (sglang style), bad `tools`."""
    if api_style not in API_STYLES:
        raise PayloadError(f"api_style must be one of {list(API_STYLES)}, got {api_style!r}", field="api_style")
    if not isinstance(payload, Mapping):
        raise PayloadError(f"payload must be an object, got {type(payload).__name__}")
    for name in AKV_FIELDS:
        if name in payload:
            raise PayloadError(f"payload already has {name!r}; pass the payload without AKV fields (the "
                               f"policy derives them from the history)", field=name)
    extra = payload.get("extra_body")
    if "extra_body" in payload:
        if api_style == "sglang":
            raise PayloadError("payload has an un-merged 'extra_body'; merge SDK extra_body fields into the "
                               "payload, or use api_style='openai'", field="extra_body")
        if not isinstance(extra, Mapping):
            raise PayloadError(f"extra_body must be an object, got {type(extra).__name__}", field="extra_body")
        for name in AKV_FIELDS:
            if name in extra:
                raise PayloadError(f"extra_body already has {name!r}; pass the payload without AKV fields",
                                   field=f"extra_body.{name}")
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise PayloadError(f"payload field 'tools' must be a list, got {type(tools).__name__}", field="tools")


def akv_fields(history: CacheOperationHistory, thinking: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The cumulative wire fields of `history`; empty fields are left out. With a reasoning schedule
    (`thinking`, possibly empty) the drops travel in a `thinking_drop` rule instead of `drop_message`."""
    fields: dict[str, Any] = {}
    drop = history.drop_message()
    if thinking is not None:
        fields["drop_rule"] = thinking_rule(thinking, drop)
    elif drop:
        fields["drop_message"] = drop
    reposition = history.reposition()
    if reposition:
        fields["reposition"] = reposition
    return fields


_SCALARS = frozenset((str, int, float, bool, type(None)))


def copy_json(value: Any, field: str = "payload", depth: int = MAX_DEPTH) -> Any:
    """Deep copy of a JSON-like value (dicts, lists, scalars); other objects go through copy.deepcopy.
    Raises PayloadError naming `field` when dicts and lists nest deeper than `MAX_DEPTH`."""
    kind = type(value)
    if kind is dict or kind is list:
        if depth == 0:
            raise PayloadError(f"{field}: nested deeper than {MAX_DEPTH} levels", field=field)
        if kind is dict:
            out = value.copy()
            for k, v in value.items():
                if type(v) not in _SCALARS:
                    out[k] = copy_json(v, field, depth - 1)
            return out
        return [v if type(v) in _SCALARS else copy_json(v, field, depth - 1) for v in value]
    if kind in _SCALARS:
        return value
    try:
        return copy.deepcopy(value)
    except RecursionError:
        raise PayloadError(f"{field}: a {kind.__name__} nested too deeply to copy", field=field) from None


def with_fields(payload: Mapping[str, Any], messages: list[Any], history: CacheOperationHistory,
                api_style: str, thinking: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """A deep copy of `payload` carrying the cumulative AKV fields of `history` (and the reasoning
    schedule `thinking`, see `akv_fields`); `messages` must be a private copy of the payload's
    messages, used as is."""
    new = {key: messages if key == "messages" else copy_json(value, key) for key, value in payload.items()}
    fields = akv_fields(history, thinking)
    if api_style == "openai":
        if fields or "extra_body" in new:
            new["extra_body"] = {**new.get("extra_body", {}), **fields}
    else:
        new.update(fields)
    return new
