"""drop_rule validation: every bad shape or over-limit value is a RuleError naming the field and value."""

from __future__ import annotations

from typing import Any

import pytest

from akv.system.context import drop_rule as dr
from akv.system.context.drop_rule import (
    KeepTextDrop,
    TextDrop,
    TextSelection,
    ThinkingDrop,
    nth_occurrence,
    parse_request_rules,
)
from akv.system.context.rules import RuleError, parse_rules

MESSAGES = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "abab ab"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "next"},
    {"role": "assistant", "content": "later"},
]


def text(entries: dict[int, Any]) -> dict[str, Any]:
    return {"type": "text_drop", "drop_messages": [entries.get(i) for i in range(len(MESSAGES))]}


def test_message_drop_is_drop_message() -> None:
    got = parse_request_rules(None, {"type": "message_drop", "drop_messages": {"3": [1, 2]}}, [3], MESSAGES)
    assert got.rules == parse_rules({"3": [1, 2]}, [3], len(MESSAGES)) and got.span is None


def test_text_drop_selections_and_occurrences() -> None:
    rule = text({1: {"role": "user", "content": ["ab", "b a"], "occurrence": [3, 1]}, 2: {"role": "assistant",
                                                                                         "content": "ok"}})
    span = parse_request_rules(None, rule, None, MESSAGES).span
    # "abab ab": "ab" matches at 0, 2, 5 (third: 5..7); "b a" at 3..6; merged 3..7.
    assert span == TextDrop(3, (TextSelection(1, ((3, 7),), False, "abab ab"), TextSelection(2, ((0, 2),), True, "ok")))


def test_a_rule_checked_against_other_content_is_refused() -> None:
    """The server normalises messages between checking the rule and rendering; a change is caught."""
    from akv.system.context.spans import SpanError, text_drops

    rule = parse_request_rules(None, text({1: {"role": "user", "content": "ab"}}), None, MESSAGES).span
    changed = [*MESSAGES[:1], {"role": "user", "content": "abab ab!"}, *MESSAGES[2:]]
    with pytest.raises(SpanError, match=r"messages\[1\].content: differs from the content"):
        text_drops(None, changed, rule, lambda variant: "")


def test_overlapping_matches_count_as_occurrences() -> None:
    assert [nth_occurrence("aaaa", "aa", k) for k in (1, 2, 3, 4)] == [0, 1, 2, -1]
    assert nth_occurrence("é漢é漢é", "é漢é", 2) == 2


def test_other_types_parse() -> None:
    full = [{"role": "user", "content": "x"}]
    assert parse_request_rules(None, {"type": "keep_text_drop", "full_messages": full}, None, MESSAGES).span == \
        KeepTextDrop(tuple(full), False)
    assert parse_request_rules(None, {"type": "thinking_drop"}, [2], MESSAGES).span == ThinkingDrop()
    assert parse_request_rules(None, {"type": "thinking_drop"}, [2], MESSAGES).rules.repositions == (2,)


BIG = "a" * (dr.MAX_PATTERN_BYTES + 1)


@pytest.mark.parametrize(
    ("drop_message", "rule", "field", "needle"),
    [
        ({"1": [0]}, {"type": "thinking_drop"}, "drop_rule", "drop_rule and drop_message are exclusive"),
        (None, [1], "drop_rule", "expected an object"),
        (None, {"type": "span_drop"}, "drop_rule.type", "'span_drop' is not one of"),
        (None, {"type": "thinking_drop", "_keep_spans": []}, "drop_rule._keep_spans", "is reserved"),
        (None, {"type": "thinking_drop", "extra": 1}, "drop_rule.extra", "not a thinking_drop field"),
        (None, {"type": "message_drop"}, "drop_rule.drop_messages", "needs drop_messages"),
        (None, {"type": "message_drop", "drop_messages": {"1": [3]}}, "drop_rule.drop_messages['1'][0]",
         "message 3 is after its anchor 1"),
        (None, {"type": "text_drop", "drop_messages": {}}, "drop_rule.drop_messages", "one entry per message"),
        (None, {"type": "text_drop", "drop_messages": [None]}, "drop_rule.drop_messages", "1 entries for 5 messages"),
        (None, text({1: {"role": "assistant", "content": "ab"}}), "drop_rule.drop_messages[1].role",
         "'assistant' is not the message's role 'user'"),
        (None, text({1: {"role": "user", "content": [""]}}), "drop_rule.drop_messages[1].content[0]",
         "non-empty string"),
        (None, text({1: {"role": "user", "content": "ab", "occurrence": 4}}), "drop_rule.drop_messages[1].content",
         "occurrence 4 of the selector is not in messages[1].content"),
        (None, text({1: {"role": "user", "content": "ab", "occurrence": 0}}),
         "drop_rule.drop_messages[1].occurrence", "occurrence must be an int"),
        (None, text({1: {"role": "user", "content": ["ab", "a"], "occurrence": [1]}}),
         "drop_rule.drop_messages[1].occurrence", "2 ints, one per selector"),
        (None, text({1: {"role": "user", "content": "ab", "where": 1}}), "drop_rule.drop_messages[1].where",
         "not a text_drop entry field"),
        (None, text({4: {"role": "assistant", "content": "late"}}), "drop_rule.drop_messages[4]",
         "not at or before the latest user message 3"),
        (None, text({1: "ab"}), "drop_rule.drop_messages[1]", "expected null or an object"),
        (None, text({1: {"role": "user", "content": ["a"] * (dr.MAX_SELECTORS + 1)}}),
         "drop_rule.drop_messages[1].content", f"1025 selectors, at most {dr.MAX_SELECTORS}"),
        (None, text({1: {"role": "user", "content": BIG}}), "drop_rule.drop_messages[1].content",
         f"pattern bytes, at most {dr.MAX_PATTERN_BYTES}"),
        (None, text({1: {"role": "user", "content": ["a", "b"], "occurrence": [dr.MAX_MATCHES, 1]}}),
         "drop_rule.drop_messages[1].content[1]", f"matches to find, at most {dr.MAX_MATCHES}"),
        (None, {"type": "keep_text_drop", "full_messages": []}, "drop_rule.full_messages", "non-empty list"),
        (None, {"type": "keep_text_drop", "full_messages": [{}], "force": 1}, "drop_rule.force", "true or false"),
    ],
)
def test_bad_rules_name_the_field(drop_message: Any, rule: Any, field: str, needle: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_request_rules(drop_message, rule, None, MESSAGES)
    assert info.value.field == field and needle in str(info.value), str(info.value)


def test_text_size_limits() -> None:
    many = [{"role": "user", "content": "x"}] * (dr.MAX_TEXT_MESSAGES + 1)
    with pytest.raises(RuleError, match=r"drop_rule.drop_messages: 4097 entries, at most 4096"):
        parse_request_rules(None, {"type": "text_drop", "drop_messages": [None] * len(many)}, None, many)
    huge = [{"role": "user", "content": "x" * (dr.MAX_TEXT_BYTES + 1)}]
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(RuleError, match="content bytes searched, at most 16777216"):
        parse_request_rules(None, rule, None, huge)
