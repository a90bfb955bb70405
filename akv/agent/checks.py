"""Constructor argument checks shared by the built-in rules."""

from __future__ import annotations

from akv.agent.counting import TokenCounter
from akv.agent.errors import ConfigError


def positive_int(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """Raise ConfigError unless `value` is an int > 0 (bools rejected; None allowed if `optional`)."""
    if optional and value is None:
        return
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def counter(owner: str, value: object) -> None:
    """Raise ConfigError unless `value` implements `TokenCounter`."""
    if value is None:
        raise ConfigError(f"{owner} needs a token counter (counter=...)")
    if not isinstance(value, TokenCounter):
        raise ConfigError(f"{owner}.counter must have a layout(messages, *, tools, chat_template_kwargs, "
                          f"api_style) method, got {type(value).__name__}")


def tool_name(owner: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}.tool_name must be a non-empty string, got {value!r}")
