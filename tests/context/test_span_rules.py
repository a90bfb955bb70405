"""text_drop, keep_text_drop and thinking_drop compiled on rendered prompts: hand-worked examples on a
one-token-per-byte tokenizer, and a brute force over random substrings on a BPE tokenizer (tokens
straddling a selection edge are kept; unicode, repeated substrings, occurrences)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from akv.system.context.compiler import append_generated
from akv.system.context.drop_rule import parse_request_rules
from akv.system.context.program import EventKind
from akv.system.context.projection import ProjectionError, project
from akv.system.context.provenance import prompt_provenance
from akv.system.context.request import compile_request, compile_rules
from akv.system.context.spans import SpanError
from akv.system.context.rules import RuleError
from akv.system.context.thinking import ThinkingError, retain_thinking
from akv.system.context.wire import decode_program, encode_program

from .conftest import load_template

ANGLE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bytes_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte: character offsets are exact, so expected tokens can be read off by hand."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["x"], trainer=trainer)
    return tok


def drops(program: Any) -> list[tuple[int, int, tuple[int, ...], tuple[tuple[int, int], ...]]]:
    return [(e.at, e.anchor, e.messages, e.ranges) for e in program.events if e.kind is EventKind.DROP]


OLD = [{"role": "user", "content": "old news"}, {"role": "assistant", "content": "answer"},
       {"role": "user", "content": "new"}]


def test_text_drop_hand_worked(bytes_tokenizer: Tokenizer) -> None:
    # "<user>old news<assistant>answer<user>new<assistant>": "news" is characters 10..14; message 2 (the
    # latest user message, the anchor) ends at character 6+8 + 11+6 + 6+3 = 40; the prompt has 51.
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": "news"}, None, None]}
    result = compile_request(bytes_tokenizer, OLD, drop_rule=rule, template=ANGLE)
    assert drops(result.program) == [(40, 2, (0,), ((10, 14),))]
    assert result.program.visible_until[10:14].tolist() == [40] * 4
    assert result.program.next_position == 51
    compact = compile_request(bytes_tokenizer, OLD, drop_rule=rule, reposition=[2], template=ANGLE).program
    assert compact.next_position == 47 and compact.final_position[40] == 36


def test_whole_selection_is_the_message_drop(bytes_tokenizer: Tokenizer) -> None:
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": ["old ", "d news"]}, None, None]}
    by_text = compile_request(bytes_tokenizer, OLD, drop_rule=rule, template=ANGLE).program
    by_message = compile_request(bytes_tokenizer, OLD, drop_message={"2": [0]}, template=ANGLE).program
    assert drops(by_text) == drops(by_message) == [(40, 2, (0,), ((0, 14),))]
    assert encode_program(by_text) == encode_program(by_message)


def test_occurrence_picks_the_repeat(bytes_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "aaa-aaa"}, {"role": "user", "content": "go"}]
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": "aa", "occurrence": 3}, None]}
    program = compile_request(bytes_tokenizer, messages, drop_rule=rule, template=ANGLE).program
    assert drops(program) == [(21, 1, (0,), ((10, 12),))]  # "<user>" + "aaa-" = 10 characters before it


def test_multibyte_characters_drop_all_their_byte_tokens(bytes_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "é漢😀"}, {"role": "user", "content": "go"}]
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": "漢"}, None]}
    program = compile_request(bytes_tokenizer, messages, drop_rule=rule, template=ANGLE).program
    assert drops(program)[0][3] == ((8, 11),)  # "<user>" 6 bytes, "é" 2, "漢" 3


def test_content_is_placed_where_rendered_not_where_first_found(bytes_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "use"}, {"role": "user", "content": "go"}]
    rule = {"type": "text_drop", "drop_messages": [{"role": "user", "content": "us"}, None]}
    program = compile_request(bytes_tokenizer, messages, drop_rule=rule, template=ANGLE).program
    assert drops(program)[0][3] == ((6, 8),)  # not the "us" of "<user>"
    with pytest.raises(SpanError, match=r"messages\[0\].content: not rendered verbatim"):
        upper = ANGLE.replace("m.content", "m.content|upper")
        compile_request(bytes_tokenizer, messages, drop_rule=rule, template=upper)
    twice = ANGLE.replace("{{ m.content }}", "{{ m.content }}{{ m.content }}")
    with pytest.raises(SpanError, match=r"messages\[0\].content: the chat template renders it more than once"):
        compile_request(bytes_tokenizer, messages, drop_rule=rule, template=twice)


def _random_text(rng: random.Random) -> str:
    pieces = ["xy", "zé", "漢字", "😀", " ", ".", "xyx", "0", "é"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))


def _brute_expected(prov: Any, messages: list[dict[str, Any]], chosen: dict[int, list[tuple[int, int]]]) -> set[int]:
    """Dropped tokens by definition: base of each content from the template's fixed scaffolding."""
    base, bases = 0, []
    for m in messages:
        bases.append(base + len(f"<|im_start|>{m['role']}\n"))
        base += len(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    dropped = set()
    for i, spans in chosen.items():
        content = messages[i]["content"]
        selected = {c for s, e in spans for c in range(s, e)}
        owned = [t for t in range(len(prov.owners)) if prov.owners[t] == i]
        if selected == set(range(len(content))):
            dropped.update(owned)
            continue
        absolute = {bases[i] + c for c in selected}
        for t in owned:
            s, e = (int(x) for x in prov.offsets[t])
            if s < e and all(c in absolute for c in range(s, e)):
                dropped.add(t)
    return dropped


@pytest.mark.parametrize("seed", range(60))
def test_text_drop_brute_force(seed: int, chatml_tokenizer: Tokenizer) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    messages = [{"role": rng.choice(["user", "assistant"]), "content": _random_text(rng)} for _ in range(n)]
    messages[-1]["role"] = "user"
    entries: list[Any] = [None] * n
    chosen: dict[int, list[tuple[int, int]]] = {}
    for i in range(n - 1):
        if rng.random() < 0.3:
            continue
        content = messages[i]["content"]
        patterns, occurrences = [], []
        for _ in range(rng.randint(1, 3)):
            s = rng.randrange(len(content))
            e = rng.randint(s + 1, len(content))
            pattern = content[s:e]
            starts = [k for k in range(len(content)) if content.startswith(pattern, k)]
            patterns.append(pattern)
            occurrences.append(starts.index(s) + 1)
            chosen.setdefault(i, []).append((s, e))
        entries[i] = {"role": messages[i]["role"], "content": patterns, "occurrence": occurrences}
    rule = {"type": "text_drop", "drop_messages": entries}
    result = compile_request(chatml_tokenizer, messages, drop_rule=rule, template=CHATML)
    program = result.program
    expected = _brute_expected(result.provenance, messages, chosen)
    assert set(np.flatnonzero(~program.keep).tolist()) == expected
    anchor_end = int(np.searchsorted(result.provenance.owners, n - 1, "right"))
    assert all(e.at == anchor_end for e in program.events)
    extended = append_generated(program, [1, 2])
    decoded = decode_program(encode_program(extended))
    assert decoded.events == extended.events and np.array_equal(decoded.visible_until, extended.visible_until)


THOUGHT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>plan</think>\n\nA"},
           {"role": "user", "content": "next"}]


def test_thinking_drop_hand_worked(bytes_tokenizer: Tokenizer) -> None:
    # "<user>q" is 7 characters, "<assistant>" 11: the block "<think>plan</think>\n\n" is 18..39, "A" 39.
    program = compile_request(bytes_tokenizer, THOUGHT, drop_rule={"type": "thinking_drop"}, template=ANGLE).program
    assert drops(program) == [(40, 1, (1,), ((18, 39),))]
    assert program.keep[39] and program.visible_until[18:39].tolist() == [40] * 21


def test_thinking_drop_refuses_both_forms_and_nesting(bytes_tokenizer: Tokenizer) -> None:
    both = [THOUGHT[0], {**THOUGHT[1], "reasoning_content": "r"}, THOUGHT[2]]
    with pytest.raises(ThinkingError, match=r"messages\[1\]: has both reasoning_content"):
        compile_request(bytes_tokenizer, both, drop_rule={"type": "thinking_drop"}, template=ANGLE)
    nested = [THOUGHT[0], {"role": "assistant", "content": "<think>a<think>b</think></think>c"}, THOUGHT[2]]
    with pytest.raises(ThinkingError, match=r"messages\[1\].content: its leading <think> block is unclosed or nested"):
        compile_request(bytes_tokenizer, nested, drop_rule={"type": "thinking_drop"}, template=ANGLE)


QWEN3_TURNS = [
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "reasoning_content": "The user asks about weather.", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow?"},
]


def test_qwen3_keeps_historical_reasoning_only_when_patched(chatml_tokenizer: Tokenizer) -> None:
    stock = load_template("qwen3.jinja")
    rules = parse_request_rules(None, {"type": "thinking_drop"}, None, QWEN3_TURNS)
    unpatched = prompt_provenance(chatml_tokenizer, QWEN3_TURNS, template=stock)
    assert "The user asks" not in unpatched.text  # Qwen3 strips reasoning before the latest user turn
    with pytest.raises(ThinkingError, match=r"messages\[1\]: the chat template did not render its reasoning"):
        compile_rules(unpatched, QWEN3_TURNS, rules, lambda variant: "")
    # The patched history equals what the earlier turn rendered (and the model generated) for message 1.
    earlier = prompt_provenance(chatml_tokenizer, QWEN3_TURNS[:2], template=stock, add_generation_prompt=False)
    patched = prompt_provenance(chatml_tokenizer, QWEN3_TURNS[:2], template=retain_thinking(stock),
                                add_generation_prompt=False)
    assert patched.text == earlier.text
    result = compile_request(chatml_tokenizer, QWEN3_TURNS, drop_rule={"type": "thinking_drop"}, template=stock)
    text, prov = result.provenance.text, result.provenance
    block = "<think>\nThe user asks about weather.\n</think>\n\n"
    start = text.index(block)
    inside = {t for t in range(len(prov.owners))
              if start <= prov.offsets[t][0] < prov.offsets[t][1] <= start + len(block)}
    assert set(np.flatnonzero(~result.program.keep).tolist()) == inside and inside
    assert "It is sunny." in text and retain_thinking(retain_thinking(stock)) == retain_thinking(stock)


FULL = [
    {"role": "user", "content": "task"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                            "function": {"name": "read", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "long result line one; line two"},
    {"role": "assistant", "content": "noted"},
    {"role": "user", "content": "go on"},
]


def test_projection_matches_from_the_end() -> None:
    visible = [FULL[0], FULL[1], {**FULL[2], "content": "line two"}, FULL[4]]
    assert project(visible, FULL).kept == ((0, 4), (0, 0), (22, 30), None, (0, 5))
    with pytest.raises(ProjectionError, match=r"messages\[1\]"):
        project([FULL[0], {**FULL[2], "tool_call_id": "c9"}, FULL[4]], FULL)
    with pytest.raises(ProjectionError, match=r"messages\[0\]"):
        project([FULL[4], FULL[0]], FULL)


def test_keep_text_drop_equals_drop_message_when_messages_go_whole(bytes_tokenizer: Tokenizer) -> None:
    visible = [FULL[0], FULL[1], FULL[4]]
    rule = {"type": "keep_text_drop", "full_messages": FULL}
    kept = compile_request(bytes_tokenizer, visible, drop_rule=rule, template=ANGLE).program
    plain = compile_request(bytes_tokenizer, FULL, drop_message={"4": [2, 3]}, template=ANGLE).program
    assert encode_program(kept) == encode_program(plain)


def test_keep_text_drop_partial_keeps_template_and_kept_text(bytes_tokenizer: Tokenizer) -> None:
    visible = [FULL[0], FULL[1], {**FULL[2], "content": "line one"}, FULL[3], FULL[4]]
    program = compile_request(bytes_tokenizer, visible, drop_rule={"type": "keep_text_drop", "full_messages": FULL},
                              template=ANGLE).program
    # "<user>task" 10, "<assistant>None" 15 (null content renders as None), "<tool>" 6: the content
    # starts at 31; cut "long result " (31..43) and "; line two" (51..61); anchored after message 4.
    assert drops(program) == [(program.n_prompt - 11, 4, (2,), ((31, 43), (51, 61)))]


def test_keep_text_drop_repositions_index_the_full_messages(bytes_tokenizer: Tokenizer) -> None:
    rule = {"type": "keep_text_drop", "full_messages": FULL}
    program = compile_request(bytes_tokenizer, [FULL[0], FULL[4]], drop_rule=rule, reposition=[4],
                              template=ANGLE).program
    assert [e.kind.name for e in program.events] == ["DROP", "REPOS"] and program.events[1].anchor == 4
    with pytest.raises(RuleError, match=r"reposition\[0\]: message id 5 is out of range for 5 messages"):
        compile_request(bytes_tokenizer, [FULL[0], FULL[4]], drop_rule=rule, reposition=[5], template=ANGLE)


def test_keep_text_drop_mismatch_fails_or_forces(bytes_tokenizer: Tokenizer) -> None:
    visible = [FULL[0], {"role": "user", "content": "not there"}]
    with pytest.raises(ProjectionError, match=r"messages\[1\]"):
        compile_request(bytes_tokenizer, visible, drop_rule={"type": "keep_text_drop", "full_messages": FULL},
                        template=ANGLE)
    forced = compile_request(bytes_tokenizer, visible, template=ANGLE,
                             drop_rule={"type": "keep_text_drop", "full_messages": FULL, "force": True})
    assert forced.program.events == () and forced.provenance.text.endswith("<user>not there<assistant>")


SCHEDULED = [*THOUGHT, {"role": "assistant", "content": "<think>x</think>B"}, {"role": "user", "content": "last"}]


def test_scheduled_thinking_and_whole_drops_share_one_drop_per_anchor(bytes_tokenizer: Tokenizer) -> None:
    # Message 1 is 7..40 (its block 18..39), message 2 "<user>next" 40..50, message 3 50..78, message 4 78..88.
    rule = {"type": "thinking_drop", "thinking": {"2": [1]}, "drop_messages": {"4": [1, 2]}}
    program = compile_request(bytes_tokenizer, SCHEDULED, drop_rule=rule, template=ANGLE).program
    assert drops(program) == [(50, 2, (1,), ((18, 39),)), (88, 4, (1, 2), ((7, 18), (39, 50)))]
    assert np.flatnonzero(~program.keep).tolist() == list(range(7, 50))
    decoded = decode_program(encode_program(program))  # message 1 is in both drops: ranges travel
    assert decoded.events == program.events and np.array_equal(decoded.visible_until, program.visible_until)
    none = compile_request(bytes_tokenizer, SCHEDULED, drop_rule={"type": "thinking_drop", "thinking": {}},
                           template=ANGLE).program
    assert none.events == ()


@pytest.mark.parametrize(
    ("rule", "error", "needle"),
    [
        ({"type": "thinking_drop", "thinking": {"2": [2]}}, RuleError,
         r"drop_rule.thinking\['2'\]\[0\]: message 2 is a user"),
        ({"type": "thinking_drop", "thinking": {"4": [1]}, "drop_messages": {"2": [1]}}, RuleError,
         r"drop_rule.thinking\['4'\]\[0\]: message 1 is dropped whole by anchor 2"),
        ({"type": "thinking_drop", "thinking": {"2": [3]}}, RuleError,
         r"drop_rule.thinking\['2'\]\[0\]: message 3 is after"),
        ({"type": "thinking_drop", "thinking": [1]}, RuleError, "drop_rule.thinking: expected an object"),
    ],
)
def test_bad_thinking_schedules(bytes_tokenizer: Tokenizer, rule: dict, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        compile_request(bytes_tokenizer, SCHEDULED, drop_rule=rule, template=ANGLE)


def test_scheduled_message_without_reasoning_is_refused(bytes_tokenizer: Tokenizer) -> None:
    plain = [*OLD, {"role": "assistant", "content": "no thoughts"}, {"role": "user", "content": "x"}]
    with pytest.raises(ThinkingError, match=r"messages\[1\]: has no reasoning to drop"):
        compile_request(bytes_tokenizer, plain, drop_rule={"type": "thinking_drop", "thinking": {"2": [1]}},
                        template=ANGLE)


@pytest.mark.parametrize("seed", range(40))
def test_keep_text_drop_brute_force(seed: int, chatml_tokenizer: Tokenizer) -> None:
    """Random trims (messages removed, contents cut to a substring) against the definition: removed
    messages go whole, cut messages lose exactly the tokens wholly inside the cut characters."""
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 6)
    full = [{"role": rng.choice(["user", "assistant"]), "content": f"#{k}#" + _random_text(rng)} for k in range(n)]
    full[-1]["role"] = "user"
    visible, chosen, removed = [], {}, set()
    for i, m in enumerate(full):
        if i < n - 1 and rng.random() < 0.3:
            removed.add(i)
            continue
        content = m["content"]
        if rng.random() < 0.5:
            s = rng.randrange(len(content))
            e = rng.randint(s, len(content))
            piece = content[s:e]
            later = any(piece in f["content"] and f["role"] == m["role"] for f in full[i + 1:])
            if content.rfind(piece) == s and not later:  # the server takes the latest message and occurrence
                visible.append({**m, "content": piece})
                cut = [(a, b) for a, b in ((0, s), (e, len(content))) if a < b]
                if cut:
                    chosen[i] = cut
                continue
        visible.append(m)
    result = compile_request(chatml_tokenizer, visible, drop_rule={"type": "keep_text_drop", "full_messages": full},
                             template=CHATML)
    prov = result.provenance
    expected = _brute_expected(prov, full, chosen)
    expected |= {t for t in range(len(prov.owners)) if prov.owners[t] in removed}
    assert set(np.flatnonzero(~result.program.keep).tolist()) == expected
