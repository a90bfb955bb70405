"""Drop / Reposition on gpt-oss-tiny: the stage-blocked oracle equals §1 applied literally, one token
at a time, with the sliding window and the sinks written out here; the Figure-5 orderings; drops
inside and outside the window; a reposition after a drop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv.system.context.request import compile_request
from akv.system.reference.gpt_oss import GptOssReferenceModel
from akv.system.reference.oracle import Drop, OracleEvent, Repos, program_events, run_oracle, run_program
from tests.gpt_oss.conftest import WINDOW
from tests.gpt_oss.conversation import MESSAGES, template_inputs

ATOL = 3e-4  # logits reach about +-40 here; FP32 round-off of two summation orders


@pytest.fixture(scope="module")
def model(gpt_oss_dir: Path) -> GptOssReferenceModel:
    return GptOssReferenceModel.from_pretrained(gpt_oss_dir)


@pytest.fixture(scope="module")
def sinks(gpt_oss_dir: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    weights = load_file(str(gpt_oss_dir / "model.safetensors"))
    return [weights[f"model.layers.{i}.self_attn.sinks"] for i in range(4)]


def one_token_at_a_time(model: GptOssReferenceModel, sinks: list[torch.Tensor], ids: list[int],
                        events: list[OracleEvent]) -> torch.Tensor:
    """Literal §1: visible token -> current position; each token computed alone. On a sliding layer
    the token at position p reads the visible keys at positions > p - WINDOW; every softmax carries
    the head's sink logit in its denominator."""
    cfg = model.config
    raw_k: list[dict[int, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
    values: list[dict[int, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
    visible_position: dict[int, int] = {}
    next_position = 0
    logits = []
    remaining = list(events)
    for t, token in enumerate(ids):
        while remaining and remaining[0].at == t:
            event = remaining.pop(0)
            if isinstance(event, Drop):
                for s in event.tokens:
                    visible_position.pop(s, None)
            else:
                visible_position = {s: i for i, s in enumerate(sorted(visible_position))}
                next_position = len(visible_position)
        position = next_position
        next_position += 1
        hidden = model.embed(torch.tensor([token]))
        for layer in range(cfg.num_layers):
            inputs = model.attention_inputs(layer, hidden)
            raw_k[layer][t], values[layer][t] = inputs.k[0], inputs.v[0]
            sources = sorted(visible_position) + [t]
            if layer % 2 == 0:
                sources = [s for s in sources if visible_position.get(s, position) > position - WINDOW]
            positions = torch.tensor([visible_position.get(s, position) for s in sources])
            keys = model.rotate(torch.stack([raw_k[layer][s] for s in sources]), positions)
            vals = torch.stack([values[layer][s] for s in sources])
            query = model.rotate(inputs.q, torch.tensor([position]))[0]
            group = cfg.num_heads // cfg.num_kv_heads
            keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,mhd->hm", query, keys) / cfg.head_dim**0.5
            weights = torch.softmax(torch.cat((scores, sinks[layer][:, None]), dim=1), dim=1)[:, :-1]
            attention = torch.einsum("hm,mhd->hd", weights, vals).reshape(1, -1)
            hidden = model.finish_layer(layer, hidden, attention)
        logits.append(model.logits(hidden)[0])
        visible_position[t] = position
    return torch.stack(logits)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 201088, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[int], list[OracleEvent]]:
    n = draw(st.integers(1, 3 * WINDOW))
    ats = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
    events: list[OracleEvent] = []
    for at in ats:
        if draw(st.booleans()):
            events.append(Repos(at))
        else:
            events.append(Drop(at, tuple(draw(st.sets(st.integers(0, at - 1), max_size=at)) if at else ())))
    return _ids(n, draw(st.integers(0, 10**6))), events


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories())
def test_blocked_oracle_equals_token_by_token_definition(
    model: GptOssReferenceModel, sinks: list[torch.Tensor], history: tuple[list[int], list[OracleEvent]]
) -> None:
    ids, events = history
    with torch.no_grad():
        expected = one_token_at_a_time(model, sinks, ids, events)
    torch.testing.assert_close(run_oracle(model, ids, events).logits, expected, atol=ATOL, rtol=0)


# A = tokens 0..5, B = 6..13, C = 14..33 (C's later queries are more than WINDOW past A).
A, B, C = range(0, 6), range(6, 14), range(14, 34)


@pytest.mark.parametrize(
    ("name", "events"),
    [
        ("drop A inside B's window", [Drop(8, tuple(A))]),
        ("drop A long out of the window", [Drop(30, tuple(A))]),
        ("drop B: A stays visible but leaves the positional window", [Drop(14, tuple(B))]),
        ("drop B after C started, then reposition", [Drop(20, tuple(B)), Repos(20)]),
        ("reposition after a drop, then more than a window", [Drop(14, tuple(A)), Repos(14), Drop(24, (14, 15))]),
        ("two repositions", [Repos(10), Drop(22, tuple(range(4, 12))), Repos(22)]),
    ],
)
def test_scenarios_equal_the_token_by_token_definition(
    model: GptOssReferenceModel, sinks: list[torch.Tensor], name: str, events: list[OracleEvent]
) -> None:
    ids = _ids(len(A) + len(B) + len(C), seed=5)
    with torch.no_grad():
        expected = one_token_at_a_time(model, sinks, ids, events)
    torch.testing.assert_close(run_oracle(model, ids, events).logits, expected, atol=ATOL, rtol=0, msg=name)


def test_figure5_orderings(model: GptOssReferenceModel) -> None:
    """'compute C, then drop A' and 'drop A, then compute C' give the same B but a different C;
    'never had A' gives a different B too (C's last queries are outside A's window on sliding layers,
    yet the full layers and the KV of B still carry A)."""
    ids = _ids(len(A) + len(B) + len(C), seed=6)
    end_b = B.stop
    c_then_drop = run_oracle(model, ids, [Drop(len(ids), tuple(A))]).logits
    drop_then_c = run_oracle(model, ids, [Drop(end_b, tuple(A))]).logits
    never_a = run_oracle(model, ids[A.stop:]).logits
    torch.testing.assert_close(c_then_drop[B.start:end_b], drop_then_c[B.start:end_b], atol=ATOL, rtol=0)
    assert (c_then_drop[end_b:] - drop_then_c[end_b:]).abs().amax(dim=1).min() > 1e-3
    assert (never_a[: len(B)] - drop_then_c[B.start:end_b]).abs().max() > 1e-2
    full = run_oracle(model, ids).logits
    torch.testing.assert_close(c_then_drop, full, atol=ATOL, rtol=0)


def test_after_a_reposition_a_sliding_layer_reads_the_last_window_of_visible_keys(model: GptOssReferenceModel) -> None:
    """Layout contract: after Drop(A) without Repos the window is positional (fewer than WINDOW keys
    right after A); after Repos it is the last WINDOW visible keys (self included)."""
    n = 30
    events: list[OracleEvent] = [Drop(12, tuple(range(4, 12))), Repos(20)]
    result = run_oracle(model, _ids(n, seed=7), events)
    layout = result.layout
    for t in range(12, n):
        stage = int(layout.birth_stage[t])
        p = int(layout.birth_position[t])
        earlier = [s for s in range(t) if int(layout.stage_positions[stage, s]) >= 0]
        read = [s for s in earlier if int(layout.stage_positions[stage, s]) > p - WINDOW] + [t]
        if t >= 20:
            assert read == (earlier + [t])[-WINDOW:], t
        else:
            assert read == [s for s in earlier + [t] if s >= t - WINDOW + 1 and not 4 <= s < 12], t


def test_tool_conversation_program_equals_the_definition(model: GptOssReferenceModel, sinks: list[torch.Tensor],
                                                         harmony_tokenizer: Any) -> None:
    """A compiled request on the real template: drop the first call and its result, reposition, then
    drop the analysis-free second call inside the last window."""
    messages, tools = template_inputs(len(MESSAGES))
    compiled = compile_request(harmony_tokenizer, messages, tools=tools,
                               drop_message={"3": [2], "8": [3, 4, 5]}, reposition=[3, 8])
    program = compiled.program
    events = program_events(program)
    assert [type(e).__name__ for e in events] == ["Drop", "Repos", "Drop", "Repos"]
    with torch.no_grad():
        expected = one_token_at_a_time(model, sinks, program.token_ids.tolist(), events)
    torch.testing.assert_close(run_program(model, program).logits, expected, atol=ATOL, rtol=0)
