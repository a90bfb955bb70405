"""The SGLang length hooks (adapter/lengths.py) without SGLang: a context request is counted by its
live length, refused naming ``messages`` when that (or its text beyond the row width) does not fit,
and its encoded program reaches the scheduler as plain bytes."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from akv.system.adapter import lengths
from akv.system.adapter.serving import UnsupportedContextRequest, error_param
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules
from akv.system.context.wire import decode_program, encode_program

# messages of 10, 2000 (a large tool result), 10 tokens and a 3-token generation prompt
SIZES = (10, 2000, 10)


def program(drop: bool):
    owners = np.repeat(np.arange(4), [*SIZES, 3])
    rules = parse_rules({"2": [1]} if drop else None, [2], 3)
    return compile_program(np.arange(owners.size) % 97, owners, rules, 3)


def test_a_dropped_large_tool_result_is_served_on_its_live_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lengths.TEXT_TOKENS_ENV, raising=False)
    encoded = lengths.encode_checked(program(True), {"max_new_tokens": 8}, 2048)
    assert encoded.live_length == 10 + 10 + 3 and encoded.n_tokens == sum(SIZES) + 3
    assert lengths.input_tokens(SimpleNamespace(context_program=encoded), list(range(2023))) == 23
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(lengths.wire_bytes(encoded)))  # SGLang's transport
    assert type(sent) is bytes and decode_program(sent).next_position == 23


def test_one_longer_than_the_context_is_refused_naming_messages_and_the_live_length() -> None:
    """Computing the result itself would take positions past the limit: it is refused, not wrapped."""
    with pytest.raises(UnsupportedContextRequest) as caught:
        lengths.encode_checked(program(True), {"max_new_tokens": 8}, 1024)
    assert error_param(caught.value) == "messages"
    assert "the live length is 23 tokens" in str(caught.value)
    assert "reaches position 2019" in str(caught.value) and "at least 996 tokens" in str(caught.value)


def test_kept_it_is_refused_naming_messages_and_the_live_length() -> None:
    with pytest.raises(UnsupportedContextRequest) as caught:
        lengths.encode_checked(program(False), {"max_new_tokens": 8}, 1024)
    assert error_param(caught.value) == "messages"
    assert "the live length is 2023 tokens" in str(caught.value)
    assert "at least 1007 more tokens" in str(caught.value)  # 2023 + 8 - 1024


def test_a_text_beyond_the_row_width_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lengths.TEXT_TOKENS_ENV, "2020")
    assert lengths.extra_columns(2048) == 0 and lengths.extra_columns(1024) == 996
    monkeypatch.setenv(lengths.TEXT_TOKENS_ENV, "1")  # never below the context length
    with pytest.raises(UnsupportedContextRequest, match="the text has 2023 tokens, more than the 2021"):
        lengths.encode_checked(program(True), {"max_new_tokens": 8}, 2022)


def test_plain_requests_keep_sglangs_counts() -> None:
    assert lengths.input_tokens(SimpleNamespace(context_program=None), [1, 2, 3]) == 3
    assert lengths.held_length(SimpleNamespace(akv=None, origin_input_ids=[1, 2])) == 2


@pytest.mark.parametrize("container", [lambda ids: array("q", ids), list])  # SGLang 0.5.16's Req holds array("q")
def test_the_scheduler_takes_a_program_only_with_the_requests_own_tokens(container) -> None:
    prog = program(True)
    data = encode_program(prog)
    ids = prog.token_ids.tolist()
    taken = lengths.request_program(SimpleNamespace(origin_input_ids=container(ids)), data, 2048)
    assert not isinstance(taken, str) and taken.token_ids.tolist() == ids
    differ = "context_program: its tokens differ from the request's input_ids"
    for other in (ids[:-1], ids + [5], ids[:7] + [ids[7] + 1] + ids[8:], []):
        assert lengths.request_program(SimpleNamespace(origin_input_ids=container(other)), data, 2048) == differ
