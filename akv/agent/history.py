"""The record of cache decisions for one conversation branch, with digests that tie it to that branch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from akv.agent.errors import HistoryError
from akv.agent.jsonvalue import validate_json

_FORMAT = "akv.cache_operation_history/1"
_SETTINGS_FIELDS = ("model", "tools", "chat_template_kwargs", "reasoning_effort")


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _canonical(value: object) -> bytes:
    return _ENCODER.encode(value).encode("ascii")


EMPTY_PREFIX = hashlib.sha256(b"akv.agent message prefix").hexdigest()


def extend_digest(digest: str, messages: Iterable[object]) -> str:
    """The prefix digest after appending `messages` to a prefix whose digest is `digest`
    (start from EMPTY_PREFIX); each step hashes the previous digest and one message's canonical JSON."""
    for message in messages:
        h = hashlib.sha256(digest.encode("ascii"))
        h.update(_canonical(message))
        digest = h.hexdigest()
    return digest


def settings_digest(payload: Mapping[str, object], api_style: str) -> str:
    """Digest of what fixes the rendered tokens besides the messages: model, tools, template options.
    Raises PayloadError naming the field when one of them is not a JSON value."""
    settings = {key: payload.get(key) for key in _SETTINGS_FIELDS}
    for key, value in settings.items():
        validate_json(value, key)
    settings["api_style"] = api_style
    return hashlib.sha256(_canonical(settings)).hexdigest()


@dataclass(frozen=True)
class CacheOperation:
    """Decisions taken after message `boundary`: hide the messages in `drop`, then, if `reposition`,
    compact the positions of the visible tokens."""

    boundary: int
    drop: tuple[int, ...] = ()
    reposition: bool = False

    def __post_init__(self) -> None:
        boundary = self.boundary
        if type(boundary) is not int or boundary < 0:
            raise HistoryError(f"CacheOperation.boundary must be a non-negative int, got {boundary!r}")
        if not isinstance(self.drop, tuple):
            raise HistoryError(f"CacheOperation.drop must be a tuple, got {type(self.drop).__name__}")
        previous = -1
        for i in self.drop:
            if type(i) is not int or not previous < i <= boundary:
                raise HistoryError(f"CacheOperation at {self.boundary}: drop id {i!r} must be an int in "
                                   f"[0, {self.boundary}], strictly increasing")
            previous = i
        if type(self.reposition) is not bool:
            raise HistoryError(f"CacheOperation.reposition must be a bool, got {self.reposition!r}")
        if not self.drop and not self.reposition:
            raise HistoryError(f"CacheOperation at {self.boundary} neither drops nor repositions")


@dataclass(frozen=True)
class CacheOperationHistory:
    """Immutable, append-only log of the operations decided for one conversation branch.

    `message_count` messages have been seen; `prefix_digest` is the digest of those messages and
    `settings_digest` that of the model/tools/template settings they were decided under. A history
    returned by `CachePolicy.process` also keeps, in memory only, a copy of those messages so that
    the next call can check its prefix without re-hashing it, and computes `prefix_digest` from that
    copy only when it is first read (by `to_json()`, a comparison, or the caller).

    `routing_key` is the branch's conversation routing key (`akv.agent.routing`): the value of the
    `x-smg-routing-key` header for harnesses that send requests themselves (None in a history read
    from JSON written without one; the next `process()` sets it)."""

    operations: tuple[CacheOperation, ...]
    message_count: int
    prefix_digest: str
    settings_digest: str
    snapshot: list[Any] | None = field(default=None, compare=False, repr=False)
    routing_key: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.operations, tuple) or not all(
                isinstance(op, CacheOperation) for op in self.operations):
            raise HistoryError("CacheOperationHistory.operations must be a tuple of CacheOperation")
        if type(self.message_count) is not int or self.message_count < 1:
            raise HistoryError(f"CacheOperationHistory.message_count must be a positive int, "
                               f"got {self.message_count!r}")
        deferred = "_digest_source" in self.__dict__
        for name in ("settings_digest",) if deferred else ("prefix_digest", "settings_digest"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise HistoryError(f"CacheOperationHistory.{name} must be a non-empty string")
        previous = -1
        hidden: set[int] = set()
        for op in self.operations:
            if op.boundary <= previous:
                raise HistoryError(f"operation boundaries must strictly increase: {op.boundary} after {previous}")
            if op.boundary >= self.message_count:
                raise HistoryError(f"operation boundary {op.boundary} is not among the "
                                   f"{self.message_count} messages seen")
            again = hidden.intersection(op.drop)
            if again:
                raise HistoryError(f"operation at {op.boundary} drops already dropped messages {sorted(again)}")
            hidden.update(op.drop)
            previous = op.boundary
        if self.snapshot is not None and len(self.snapshot) != self.message_count:
            raise HistoryError(f"CacheOperationHistory.snapshot must hold {self.message_count} messages")
        if self.routing_key is not None and (not isinstance(self.routing_key, str) or not self.routing_key):
            raise HistoryError(f"CacheOperationHistory.routing_key must be a non-empty string or None, "
                               f"got {self.routing_key!r}")

    @classmethod
    def extending(cls, base: CacheOperationHistory | None, operations: tuple[CacheOperation, ...],
                  settings_digest: str, snapshot: list[Any], routing_key: str | None = None
                  ) -> CacheOperationHistory:
        """The history of the messages in `snapshot` (a private copy, which `base`, if given, covers a
        prefix of). Its `prefix_digest` is computed from the snapshot when first read, so that
        `process()` hashes nothing unless the history is serialised or compared."""
        history = cls.__new__(cls)
        source = (EMPTY_PREFIX, 0) if base is None else base._digest_base()
        for name, value in (("operations", operations), ("message_count", len(snapshot)),
                            ("settings_digest", settings_digest), ("snapshot", snapshot),
                            ("routing_key", routing_key), ("_digest_source", source)):
            object.__setattr__(history, name, value)
        history.__post_init__()
        return history

    def _digest_base(self) -> tuple[str, int]:
        """A known digest of the first messages of the snapshot, and how many messages it covers."""
        if "prefix_digest" in self.__dict__:
            return self.prefix_digest, self.message_count
        return self.__dict__["_digest_source"]

    def __getattr__(self, name: str) -> Any:
        """Reached only for attributes not set: computes and keeps a deferred `prefix_digest`."""
        source = self.__dict__.get("_digest_source")
        if name != "prefix_digest" or source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        digest, covered = source
        digest = extend_digest(digest, self.snapshot[covered:])
        object.__setattr__(self, "prefix_digest", digest)
        return digest

    @property
    def hidden(self) -> frozenset[int]:
        """Every message id dropped so far."""
        return frozenset(i for op in self.operations for i in op.drop)

    def drop_message(self) -> dict[str, list[int]]:
        """The cumulative wire field `drop_message` (string keys)."""
        return {str(op.boundary): list(op.drop) for op in self.operations if op.drop}

    def reposition(self) -> list[int]:
        """The cumulative wire field `reposition`."""
        return [op.boundary for op in self.operations if op.reposition]

    def to_json(self) -> str:
        data = {
            "format": _FORMAT,
            "message_count": self.message_count,
            "prefix_digest": self.prefix_digest,
            "settings_digest": self.settings_digest,
            "operations": [{"boundary": op.boundary, "drop": list(op.drop), "reposition": op.reposition}
                           for op in self.operations],
        }
        if self.routing_key is not None:
            data["routing_key"] = self.routing_key
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> CacheOperationHistory:
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise HistoryError(f"history is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise HistoryError(f"history JSON must be an object with format {_FORMAT!r}")
        ops = data.get("operations")
        if not isinstance(ops, list):
            raise HistoryError("history JSON field 'operations' must be a list")
        operations = []
        for k, op in enumerate(ops):
            if not isinstance(op, dict) or set(op) != {"boundary", "drop", "reposition"}:
                raise HistoryError(f"history JSON operations[{k}] must have exactly boundary, drop, reposition")
            if not isinstance(op["drop"], list):
                raise HistoryError(f"history JSON operations[{k}].drop must be a list")
            operations.append(CacheOperation(op["boundary"], tuple(op["drop"]), op["reposition"]))
        return cls(tuple(operations), data.get("message_count"), data.get("prefix_digest"),
                   data.get("settings_digest"), routing_key=data.get("routing_key"))
