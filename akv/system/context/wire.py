"""Compact byte form of a :class:`ContextProgram` for inter-process transport.

Only the inputs travel: token ids, tokens per owner message, and the operations (drops and
repositions by anchor). :func:`decode_program` checks the framing and a CRC-32 checksum, then
rebuilds every derived array with the compiler, so a decoded program is valid by construction.

Layout (little-endian): ``b"AKVP"``, u16 version, u16 flags (0), u32 ``n_tokens``, ``n_prompt``,
``n_messages``, ``n_drops``, ``n_dropped``, ``n_repos``; then int32 arrays ``token_ids[n_tokens]``,
``counts[n_messages + 1]`` (prompt tokens per owner, the last one being the reply),
``drop_anchors[n_drops]``, ``drop_sizes[n_drops]``, ``dropped[n_dropped]``, ``repos[n_repos]``;
then, when flag bit 0 (``RANGES``) is set, because some drop hides part of a message (a text span)
rather than whole messages: ``n_ranges``, ``range_counts[n_drops]`` and ``ranges[2 * n_ranges]``
(half-open token ranges of each drop, in order); then the CRC-32 of everything before it (u32).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from akv.system.context.compiler import (
    ProgramError,
    TokenDrop,
    append_generated,
    check_non_negative,
    message_drops,
    program_of_rules,
    program_of_token_drops,
)
from akv.system.context.program import ContextProgram, EventKind
from akv.system.context.rules import ContextRules, Drop, RuleError

MAGIC = b"AKVP"
VERSION = 2
RANGES = 1
_HEADER = struct.Struct("<4sHHIIIIII")
_DIGEST = 4
_INT32_MAX = np.iinfo(np.int32).max
_I32 = np.dtype("<i4")


class WireError(ValueError):
    """Bytes do not decode to a valid program, or a program cannot be encoded."""


def encode_program(program: ContextProgram) -> bytes:
    """Serialise ``program``; raises :class:`WireError` if a value does not fit the format."""
    n_prompt = program.n_prompt
    generated_owners = program.owners[n_prompt:]
    if generated_owners.size and np.any(generated_owners != program.n_messages):
        raise WireError("owners: generated tokens must be owned by the reply (n_messages)")
    if program.token_ids.size and int(program.token_ids.max()) > _INT32_MAX:
        raise WireError(f"token_ids: id {int(program.token_ids.max())} does not fit int32")
    if program.n_tokens > _INT32_MAX:
        raise WireError(f"n_tokens: {program.n_tokens} does not fit int32")
    counts = np.bincount(program.owners[:n_prompt], minlength=program.n_messages + 1)
    drops = [e for e in program.events if e.kind is EventKind.DROP]
    repos = [e.anchor for e in program.events if e.kind is EventKind.REPOS]
    dropped = [m for e in drops for m in e.messages]
    whole = message_drops(program.owners[:n_prompt], [Drop(e.anchor, e.messages) for e in drops])
    flags = 0 if [d.ranges for d in whole] == [e.ranges for e in drops] else RANGES
    body = b"".join(
        [
            _HEADER.pack(
                MAGIC, VERSION, flags, program.n_tokens, n_prompt, program.n_messages, len(drops), len(dropped),
                len(repos)
            ),
            _int32(program.token_ids),
            _int32(counts),
            _int32([e.anchor for e in drops]),
            _int32([len(e.messages) for e in drops]),
            _int32(dropped),
            _int32(repos),
            _ranges(drops) if flags else b"",
        ]
    )
    return body + _digest(body)


def decode_program(data: bytes) -> ContextProgram:
    """Parse and fully re-validate bytes produced by :func:`encode_program`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"data: expected bytes, got {type(data).__name__}")
    if not isinstance(data, bytes):
        data = bytes(data)
    if len(data) < _HEADER.size + _DIGEST:
        raise WireError(f"data: {len(data)} bytes is shorter than the {_HEADER.size + _DIGEST}-byte frame")
    magic, version, flags, n_tokens, n_prompt, n_messages, n_drops, n_dropped, n_repos = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"magic: {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"version: {version} is not supported (expected {VERSION})")
    if flags not in (0, RANGES):
        raise WireError(f"flags: {flags} must be 0 or {RANGES}")
    sizes = [n_tokens, n_messages + 1, n_drops, n_drops, n_dropped, n_repos]
    expected = _HEADER.size + 4 * sum(sizes) + _DIGEST
    n_ranges = 0
    if flags:
        at = expected - _DIGEST
        n_ranges = struct.unpack_from("<I", data, at)[0] if len(data) >= at + 4 else 0
        sizes += [1, n_drops, 2 * n_ranges]
        expected += 4 * (1 + n_drops + 2 * n_ranges)
    if len(data) != expected:
        raise WireError(f"data: {len(data)} bytes, the header announces {expected}")
    body = memoryview(data)[:-_DIGEST]
    if _digest(body) != data[-_DIGEST:]:
        raise WireError("digest: content does not match its checksum")
    arrays = []
    offset = _HEADER.size
    for size in sizes:
        arrays.append(np.frombuffer(body, dtype=_I32, count=size, offset=offset).astype(np.int64))
        offset += 4 * size
    token_ids, counts, anchors, drop_sizes, dropped, repos = arrays[:6]
    if n_prompt > n_tokens:
        raise WireError(f"n_prompt: {n_prompt} exceeds n_tokens {n_tokens}")
    if np.any(counts < 0) or int(counts.sum()) != n_prompt:
        raise WireError(f"counts: per-message token counts must be non-negative and sum to n_prompt {n_prompt}")
    if np.any(drop_sizes < 1) or int(drop_sizes.sum()) != n_dropped:
        raise WireError(f"drop_sizes: each drop needs at least one message and the sizes must sum to {n_dropped}")
    splits = np.cumsum(drop_sizes)[:-1]
    messages = [tuple(int(m) for m in msgs) for msgs in np.split(dropped, splits)]
    try:
        check_non_negative(token_ids, "token_ids")
        owners = np.repeat(np.arange(n_messages + 1, dtype=np.int64), counts)  # non-decreasing, in range
        prompt = token_ids[:n_prompt]
        if flags:
            program = program_of_token_drops(
                prompt, owners, _token_drops(anchors, messages, arrays[7], arrays[8], n_ranges),
                tuple(int(r) for r in repos.tolist()), n_messages,
            )
        else:
            rules = ContextRules(
                drops=tuple(Drop(int(a), msgs) for a, msgs in zip(anchors.tolist(), messages)),
                repositions=tuple(int(r) for r in repos.tolist()),
            )
            program = program_of_rules(prompt, owners, rules, n_messages)
        return append_generated(program, token_ids[n_prompt:])
    except (RuleError, ProgramError) as err:
        raise WireError(f"program: {err}") from err


def _ranges(drops: list) -> bytes:
    flat = [x for e in drops for r in e.ranges for x in r]
    return _int32([len(flat) // 2]) + _int32([len(e.ranges) for e in drops]) + _int32(flat)


def _token_drops(
    anchors: np.ndarray, messages: list[tuple[int, ...]], counts: np.ndarray, flat: np.ndarray, n_ranges: int
) -> tuple[TokenDrop, ...]:
    if np.any(counts < 0) or int(counts.sum()) != n_ranges:
        raise WireError(f"range_counts: each count must be non-negative and they must sum to n_ranges {n_ranges}")
    pairs = [(int(s), int(e)) for s, e in flat.reshape(-1, 2).tolist()]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return tuple(
        TokenDrop(int(a), msgs, tuple(pairs[bounds[i] : bounds[i + 1]]))
        for i, (a, msgs) in enumerate(zip(anchors.tolist(), messages))
    )


def _int32(values: object) -> bytes:
    return np.asarray(values, dtype=np.int64).astype(_I32).tobytes()


def _digest(body: bytes | memoryview) -> bytes:
    return struct.pack("<I", zlib.crc32(body))
