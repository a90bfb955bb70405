"""Offsets of the server's own token ids, read from their bytes: equal to what the tokenizer's
``encode`` reports, or not read at all (and the prompt encoded) when they could differ."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors

from akv.system.context.byte_offsets import spelled_offsets
from akv.system.context.drop_rule import parse_request_rules
from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.context.request import compile_parsed
from akv.system.context.wire import encode_program
from akv.system.models.tiny import build_tokenizer

from .conftest import load_template

PIECES = ["a", "b", "ab", " ", "  ", "\n", "\t", "\r\n", "é", "e\u0301", "ß", "中文", "東京", "😀", "👍🏽", "🦜",
          "\u200d", "\U0010ffff", "\x00", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "{\"k\": 1}",
          "Ġ", "Ωmega", "résumé", "12345"]
texts = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return build_tokenizer(800)


def _reference(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.int64), np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_offsets_of_the_encoded_ids_are_the_tokenizers_own(text: str, chatml_tokenizer: Any,
                                                          tiny_tokenizer: Any) -> None:
    for tokenizer in (chatml_tokenizer, tiny_tokenizer):
        ids, offsets = _reference(tokenizer, text)
        got = spelled_offsets(tokenizer, ids, text)
        assert got is not None and got.dtype == np.int64
        assert np.array_equal(got, offsets)


def test_a_character_split_between_tokens_belongs_to_both(tiny_tokenizer: Any) -> None:
    text = "x🦜y"
    ids, _ = _reference(tiny_tokenizer, text)
    got = spelled_offsets(tiny_tokenizer, ids, text)
    parrot = [i for i, (s, e) in enumerate(got.tolist()) if s <= 1 < e]
    assert len(parrot) > 1 and all(got[i].tolist() == [1, 2] for i in parrot)


@pytest.mark.parametrize("change", ["other text", "one id changed", "one id more", "one id less", "unknown id"])
def test_ids_that_do_not_spell_the_text_are_not_read(change: str, chatml_tokenizer: Any) -> None:
    text = "<|im_start|>user\nrésumé 😀 abcd<|im_end|>"
    ids, _ = _reference(chatml_tokenizer, text)
    variants = {
        "other text": (ids, text.replace("abcd", "abce")),
        "one id changed": (np.concatenate([ids[:3], [ids[3] + 1], ids[4:]]), text),
        "one id more": (np.concatenate([ids, ids[-1:]]), text),
        "one id less": (ids[:-1], text),
        "unknown id": (np.concatenate([ids, [chatml_tokenizer.get_vocab_size() + 5]]), text),
    }
    got_ids, got_text = variants[change]
    assert spelled_offsets(chatml_tokenizer, got_ids.astype(np.int64), got_text) is None


def test_text_that_is_not_unicode_is_not_read(chatml_tokenizer: Any) -> None:
    assert spelled_offsets(chatml_tokenizer, np.zeros(0, dtype=np.int64), "\ud800") is None


def test_empty_prompt(chatml_tokenizer: Any) -> None:
    got = spelled_offsets(chatml_tokenizer, np.zeros(0, dtype=np.int64), "")
    assert got is not None and got.shape == (0, 2)


def _variant(base: Tokenizer, change: str) -> Tokenizer:
    tokenizer = Tokenizer.from_str(base.to_str())
    if change == "trimmed offsets":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    elif change == "NFC normalizer":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.add_tokens([AddedToken("<K>", normalized=False)])  # the Kelvin sign normalises to K
    elif change == "prefix space":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "removing split":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif change == "whitespace split":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif change == "stripping added token":
        tokenizer.add_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    elif change == "metaspace":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    return tokenizer


# Per excluded pipeline: a text the server could have rendered, and whether reading its ids against
# the (ASCII) text they spell would be wrong: not that text's encoding, or offsets not the token spans.
EXCLUDED = [("trimmed offsets", "alpha beta gamma", True), ("NFC normalizer", "<\u212a>", True),
            ("removing split", "ab a b", True), ("whitespace split", "ab a b", True), ("prefix space", "a b", False),
            ("stripping added token", "a <mask> b", False), ("metaspace", "a b", True)]


@pytest.mark.parametrize(("change", "server_text", "wrong"), EXCLUDED)
def test_pipelines_that_may_rewrite_text_or_offsets_are_encoded_instead(
    change: str, server_text: str, wrong: bool, tiny_tokenizer: Any
) -> None:
    tokenizer = _variant(tiny_tokenizer, change)
    ids, _ = _reference(tokenizer, server_text)
    spelled = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert spelled_offsets(tokenizer, ids, spelled) is None
    ends = np.cumsum([len(tokenizer.decode([i], skip_special_tokens=False)) for i in ids.tolist()], dtype=np.int64)
    spans = np.stack([ends - np.diff(ends, prepend=0), ends], axis=1)
    encoded_ids, encoded_offsets = _reference(tokenizer, spelled)
    assert spelled.isascii()
    assert (not np.array_equal(encoded_ids, ids) or not np.array_equal(encoded_offsets, spans)) == wrong


AGENT = [
    {"role": "system", "content": "Agent 🤖 for résumé work."},
    {"role": "user", "content": "Read 東京.txt 🦜"},
    {"role": "assistant", "content": "<think>\nLook e\u0301 up.\n</think>\n\nReading.",
     "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": "東京.txt"}}}]},
    {"role": "tool", "content": "ß\u200d👍🏽\n\tdone"},
    {"role": "user", "content": "  and now?  "},
]


@pytest.mark.parametrize("name", ["qwen3.jinja", "qwen2_5.jinja"])
def test_provenance_from_the_servers_ids_equals_provenance_from_encoding(name: str, chatml_tokenizer: Any) -> None:
    owned = ChatTemplate(load_template(name)).render_owned(AGENT)
    server_ids = chatml_tokenizer.encode(owned.text, add_special_tokens=False).ids
    encoded = token_provenance(owned, chatml_tokenizer)
    given_ids = token_provenance(owned, chatml_tokenizer, server_ids)
    for field in ("token_ids", "offsets", "owners", "boundary_tokens"):
        a, b = getattr(encoded, field), getattr(given_ids, field)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), field
        assert not b.flags.writeable
    assert given_ids.text == encoded.text and given_ids.n_messages == encoded.n_messages


def test_ids_of_another_render_are_replaced_by_the_encoding(chatml_tokenizer: Any) -> None:
    owned = ChatTemplate(load_template("qwen3.jinja")).render_owned(AGENT)
    other = chatml_tokenizer.encode(owned.text.replace("done", "dome"), add_special_tokens=False).ids
    prov = token_provenance(owned, chatml_tokenizer, other)
    assert prov.token_ids.tolist() == chatml_tokenizer.encode(owned.text, add_special_tokens=False).ids


def test_tokenizer_that_gained_tokens_is_read_again(tiny_tokenizer: Any) -> None:
    tokenizer = Tokenizer.from_str(tiny_tokenizer.to_str())
    text = "one <extra> two"
    ids, _ = _reference(tokenizer, text)
    assert spelled_offsets(tokenizer, ids, text) is not None
    tokenizer.add_tokens(["<extra>"])
    ids, offsets = _reference(tokenizer, text)
    assert tokenizer.token_to_id("<extra>") in ids.tolist()
    assert np.array_equal(spelled_offsets(tokenizer, ids, text), offsets)


@pytest.mark.parametrize(("drops", "rule"), [({"4": [1, 3]}, None), (None, {"type": "thinking_drop"})])
def test_program_from_the_servers_ids_equals_the_program_from_encoding(drops: Any, rule: Any,
                                                                       chatml_tokenizer: Any) -> None:
    template = load_template("qwen3.jinja")
    rules = parse_request_rules(drops, rule, [2, 4], AGENT)
    encoded = compile_parsed(chatml_tokenizer, AGENT, rules, template=template)
    server_ids = chatml_tokenizer.encode(encoded.provenance.text, add_special_tokens=False).ids
    given_ids = compile_parsed(chatml_tokenizer, AGENT, rules, template=template, prompt_ids=server_ids)
    assert encoded.program.events and encode_program(given_ids.program) == encode_program(encoded.program)
    assert given_ids.provenance.offsets.tobytes() == encoded.provenance.offsets.tobytes()
