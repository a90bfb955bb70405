"""Wire form: exact round trip and rejection of corrupted or inconsistent bytes."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings

from akv.system.context.compiler import ProgramError, TokenDrop, append_generated, compile_program, compile_token_drops
from akv.system.context.program import ContextProgram
from akv.system.context.rules import parse_rules
from akv.system.context.wire import RANGES, WireError, decode_program, encode_program

from .strategies import History, histories

_ARRAYS = ("token_ids", "owners", "birth_position", "birth_stage", "final_position", "keep", "visible_until")


def _assert_same(a: ContextProgram, b: ContextProgram) -> None:
    for name in _ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    scalars = ("n_prompt", "n_messages", "next_position", "events")
    assert [getattr(a, s) for s in scalars] == [getattr(b, s) for s in scalars]
    assert len(a.transitions) == len(b.transitions)
    for x, y in zip(a.transitions, b.transitions):
        assert x.event == y.event
        for name in ("tokens", "old_positions", "new_positions"):
            assert np.array_equal(getattr(x, name), getattr(y, name))


def _sample() -> ContextProgram:
    owners = [0, 0, 1, 1, 1, 2, 3, 3, 4, 4]
    program = compile_program(np.arange(100, 110), owners, parse_rules({"1": [0], "3": [2, 1]}, [1, 3], 4), 4)
    return append_generated(program, [7, 8])


def _reframe(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _fields(data: bytes) -> list[int]:
    header = struct.unpack_from("<4sHHIIIIII", data)
    n_tokens, _, n_messages, n_drops, n_dropped, n_repos = header[3:]
    ints = list(struct.unpack_from(f"<{n_tokens + n_messages + 1 + 2 * n_drops + n_dropped + n_repos}i", data, 32))
    return list(header) + ints


def _pack(fields: list[int]) -> bytes:
    return _reframe(struct.pack("<4sHHIIIIII", *fields[:9]) + struct.pack(f"<{len(fields) - 9}i", *fields[9:]))


@settings(max_examples=150, deadline=None)
@given(histories())
def test_round_trip_is_exact(history: History) -> None:
    n_messages, owners, drop_message, reposition, generated = history
    rules = parse_rules({str(k): v for k, v in drop_message.items()}, reposition or None, n_messages)
    program = compile_program([(5 * t) % 97 for t in range(len(owners))], owners, rules, n_messages)
    program = append_generated(program, list(range(generated)))
    data = encode_program(program)
    _assert_same(decode_program(data), program)
    assert decode_program(bytearray(data)).next_position == program.next_position


def test_size_is_four_bytes_per_token_plus_operations() -> None:
    program = _sample()
    header, digest = 32, 4
    assert len(encode_program(program)) == header + 4 * (12 + 5 + 2 + 2 + 3 + 2) + digest


def test_every_single_byte_flip_is_rejected() -> None:
    data = encode_program(_sample())
    for i in range(len(data)):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x5A
        with pytest.raises(WireError):
            decode_program(bytes(corrupt))


def test_truncated_or_extended_bytes_are_rejected() -> None:
    data = encode_program(_sample())
    for n in range(len(data)):
        with pytest.raises(WireError):
            decode_program(data[:n])
    with pytest.raises(WireError, match="the header announces"):
        decode_program(data + b"\0")
    with pytest.raises(WireError, match="expected bytes"):
        decode_program("text")  # type: ignore[arg-type]


# Field indexes in _fields(): 0 magic, 1 version, 2 flags, 3 n_tokens, 4 n_prompt, 5 n_messages,
# 6 n_drops, 7 n_dropped, 8 n_repos, 9.. token ids (12), counts (5), anchors (2), sizes (2),
# dropped (3), repos (2).
@pytest.mark.parametrize(
    ("index", "value", "text"),
    [
        (0, b"XKVP", "magic: b'XKVP'"),
        (1, 1, "version: 1 is not supported"),
        (2, 2, "flags: 2 must be 0 or 1"),
        (4, 13, "n_prompt: 13 exceeds n_tokens 12"),
        (9, -1, r"program: token_ids\[0\]: negative value -1"),
        (20, -5, r"program: token_ids\[11\]: negative value -5"),
        (21, 3, "counts: .* sum to n_prompt 10"),
        (21, -1, "counts: .* non-negative"),
        (27, 9, r"program: rules: message id 9 is out of range for 4 messages"),
        (27, 1, r"program: drops\[1\]\.anchor: anchor 1 does not follow 1"),
        (28, 2, "drop_sizes: .* must sum to 3"),
        (30, 3, r"program: drops\[0\]\.messages\[0\]: message 3 is after its anchor 1"),
        (31, 0, r"program: drops\[1\]\.messages\[0\]: message 0 is already dropped"),
        (34, 1, r"program: repositions\[1\]: anchor 1 does not follow 1"),
    ],
)
def test_inconsistent_content_with_valid_digest_is_rejected(index: int, value: object, text: str) -> None:
    fields = _fields(encode_program(_sample()))
    assert fields[9:21] == list(range(100, 110)) + [7, 8]
    fields[index] = value
    with pytest.raises(WireError, match=text):
        decode_program(_pack(fields))


def test_unencodable_programs_are_refused() -> None:
    program = compile_program([2**31], [0], parse_rules(None, None, 1), 1)
    with pytest.raises(WireError, match="token_ids: id 2147483648 does not fit int32"):
        encode_program(program)


def _ranged() -> ContextProgram:
    """Drops of parts of messages (text spans), which travel as explicit token ranges."""
    owners = [0, 0, 0, 1, 1, 2, 2, 2, 3]
    drops = [TokenDrop(1, (0,), ((1, 2),)), TokenDrop(2, (0, 1), ((0, 1), (3, 4)))]
    return append_generated(compile_token_drops(np.arange(50, 59), owners, drops, [2], 3), [9])


def test_token_range_drops_round_trip_and_resist_corruption() -> None:
    program = _ranged()
    data = encode_program(program)
    assert struct.unpack_from("<H", data, 6)[0] == RANGES
    _assert_same(decode_program(data), program)
    for i in range(len(data)):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x5A
        with pytest.raises(WireError):
            decode_program(bytes(corrupt))


@pytest.mark.parametrize(
    ("drops", "text"),
    [
        ([TokenDrop(1, (0,), ((1, 6),))], r"drops\[0\]\.ranges\[0\]: range \(1, 6\) .* end by token 5"),
        ([TokenDrop(1, (0,), ((0, 2),)), TokenDrop(2, (0,), ((1, 3),))], "token 1 is hidden by two drops"),
        ([TokenDrop(2, (0,), ((0, 1),)), TokenDrop(1, (0,), ((2, 3),))],
         r"drops\[1\]\.anchor: anchor 1 does not follow 2"),
        ([TokenDrop(1, (0,), ((0, 2), (2, 3)))], r"drops\[0\]\.ranges\[1\]"),
    ],
)
def test_bad_token_drops_are_refused(drops: list, text: str) -> None:
    with pytest.raises(ProgramError, match=text):
        compile_token_drops(np.arange(9), [0, 0, 0, 1, 1, 2, 2, 2, 3], drops, [], 3)
