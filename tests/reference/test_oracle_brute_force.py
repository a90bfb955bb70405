"""The stage-blocked oracle equals the definition applied literally, one token at a time."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, OracleEvent, Repos, run_oracle


def one_token_at_a_time(model: ReferenceModel, ids: list[int], events: list[OracleEvent]) -> torch.Tensor:
    """Literal §1: a dict of visible token -> current position; each token computed alone."""
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
            positions = torch.tensor([visible_position.get(s, position) for s in sources])
            keys = model.rotate(torch.stack([raw_k[layer][s] for s in sources]), positions)
            vals = torch.stack([values[layer][s] for s in sources])
            query = model.rotate(inputs.q, torch.tensor([position]))
            attention = model.attend(query, keys, vals, torch.ones(1, len(sources), dtype=torch.bool))
            hidden = model.finish_layer(layer, hidden, attention)
        logits.append(model.logits(hidden)[0])
        visible_position[t] = position
    return torch.stack(logits)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[int], list[OracleEvent]]:
    n = draw(st.integers(1, 20))
    ids = draw(st.lists(st.integers(0, 511), min_size=n, max_size=n))
    ats = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    events: list[OracleEvent] = []
    for at in ats:
        if draw(st.booleans()):
            events.append(Repos(at))
        else:
            events.append(Drop(at, tuple(draw(st.sets(st.integers(0, at - 1), max_size=at)) if at else ())))
    return ids, events


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories())
def test_blocked_oracle_equals_token_by_token_definition(
    qwen3: ReferenceModel, history: tuple[list[int], list[OracleEvent]]
) -> None:
    ids, events = history
    with torch.no_grad():
        expected = one_token_at_a_time(qwen3, ids, events)
    torch.testing.assert_close(run_oracle(qwen3, ids, events).logits, expected, atol=5e-5, rtol=0)
