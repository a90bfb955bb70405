"""The one exception hierarchy of `akv.agent`."""

from __future__ import annotations


class AKVError(Exception):
    """Base class of every error raised by `akv.agent`."""


class ConfigError(AKVError, ValueError):
    """A rule, policy or tool was constructed with a bad argument."""


class PayloadError(AKVError, ValueError):
    """The chat payload is malformed; `message_id` names the offending message when there is one."""

    def __init__(self, message: str, *, message_id: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.message_id = message_id
        self.field = field


class HistoryError(AKVError, ValueError):
    """A `CacheOperationHistory` is invalid or does not belong to this conversation branch."""


class RuleError(AKVError):
    """A trigger, selector or reposition rule returned something the policy cannot use."""


class TokenCountError(AKVError):
    """Counting tokens with a chat template failed or gave an inconsistent layout."""


class BackendError(AKVError):
    """A chat request failed; `status` is the HTTP status (None when there was none) and `body` the
    error text the server sent (empty when there was none)."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class TransportError(BackendError):
    """The server could not be reached, the connection broke, or the call timed out."""


class HTTPStatusError(BackendError):
    """The server answered with an HTTP error status."""


class ContextLengthError(BackendError):
    """The prompt does not fit the model's context (HTTP error or error event)."""


class StreamError(BackendError):
    """The SSE stream carried an error event or a malformed event."""


class IncompleteStreamError(BackendError):
    """The SSE stream ended before `data: [DONE]`."""
