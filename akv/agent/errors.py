"""The one exception hierarchy of `akv.agent`."""

from __future__ import annotations


class AKVError(Exception):
    """Base class of every error raised by `akv.agent`."""


class ConfigError(AKVError, ValueError):
    """A rule, policy, tool or client call was given a bad argument (the message names it)."""


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


class MissingExtraError(AKVError, ImportError):
    """A feature needs an optional extra that is not installed; the message says which and how."""


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


class RedirectError(HTTPStatusError):
    """The server answered with a redirect (3xx), which is not followed: a POST is never re-sent
    elsewhere; `location` is where it pointed (None when it said nothing)."""

    def __init__(self, message: str, *, status: int, body: str = "", location: str | None = None) -> None:
        super().__init__(message, status=status, body=body)
        self.location = location


class UnexpectedResponseError(BackendError):
    """The server answered with a success status but not with an SSE stream (for example a JSON body
    or an HTML page from a proxy); `body` holds what it sent."""


class ContextLengthError(BackendError):
    """The prompt does not fit the model's context (HTTP error or error event)."""


class StreamError(BackendError):
    """The SSE stream carried an error event or a malformed event."""


class IncompleteStreamError(BackendError):
    """The SSE stream ended before `data: [DONE]`, possibly in the middle of an event (then `body`
    holds the unfinished event)."""
