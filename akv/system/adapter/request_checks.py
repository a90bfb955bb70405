"""Checks of every OpenAI request (plain or context) before SGLang converts it, for input that stock
code would answer late or with Python internals: each problem is a :class:`RequestFieldError`, a 400
whose ``param`` and message name the field and what is wrong with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
"""The sampler keeps a request's seed in a signed 64-bit integer."""

TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "add_generation_prompt", "tokenize",
                                "return_dict"})
"""Names the server itself passes to ``apply_chat_template`` and the template; a
``chat_template_kwargs`` entry under one of them would collide."""


class RequestFieldError(ValueError):
    """A request field SGLang cannot serve; ``param`` names the top-level field."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.param = where.split("[", 1)[0].split(".", 1)[0]


def check(request: Any) -> None:
    """Raise :class:`RequestFieldError` for the first problem found in ``request``."""
    n = getattr(request, "n", None)
    if isinstance(n, int) and n < 1:
        raise RequestFieldError("n", f"must be at least 1, got {n}")
    seed = getattr(request, "seed", None)
    if isinstance(seed, int) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        digits = str(seed)
        shown = digits if len(digits) <= 40 else f"{digits[:20]}... ({len(digits)} digits)"
        raise RequestFieldError("seed", f"must fit a signed 64-bit integer ({SEED_RANGE[0]} to {SEED_RANGE[1]}), "
                                        f"got {shown}")
    kwargs = getattr(request, "chat_template_kwargs", None)
    clash = sorted(set(kwargs) & TEMPLATE_ARGUMENTS) if isinstance(kwargs, Mapping) else []
    if clash:
        raise RequestFieldError(f"chat_template_kwargs[{clash[0]!r}]",
                                "set by the server from the request itself; remove it from chat_template_kwargs")
    for i, message in enumerate(getattr(request, "messages", None) or ()):
        for j, call in enumerate(getattr(message, "tool_calls", None) or ()):
            name = getattr(getattr(call, "function", None), "name", None)
            if not isinstance(name, str) or not name:
                raise RequestFieldError(f"messages[{i}].tool_calls[{j}].function.name",
                                        "missing; every tool call needs the name of the function it calls")
    where = _unencodable(request, "")
    if where is not None:
        raise RequestFieldError(where or "body", "a lone UTF-16 surrogate, which no UTF-8 text can hold; send "
                                                 "valid Unicode (escape pairs \\ud83d\\ude00 together)")


def _unencodable(value: Any, path: str) -> str | None:
    """Path of the first string in ``value`` that UTF-8 cannot encode (a lone surrogate), else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
        return next((p for i, v in items if (p := _unencodable(v, f"{path}[{i}]")) is not None), None)
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _unencodable(key, path) or _unencodable(item, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    fields = getattr(type(value), "model_fields", None)
    if fields is None:
        return None
    for name in fields:
        found = _unencodable(getattr(value, name, None), f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None
