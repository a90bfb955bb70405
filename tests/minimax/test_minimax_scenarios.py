"""Drop / Reposition on the tiny MiniMax-M2: the oracle equals (1) the definition applied one token at a
time and (2) transformers driven stage by stage, dropped keys masked out and cached keys re-rotated by
``rerotate_kv_reference`` (first 64 dims only), for token-level events and for a compiled tool chat."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from akv.system.context.compiler import compile_program
from akv.system.context.provenance import prompt_provenance
from akv.system.context.rules import parse_rules
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec
from akv.system.reference.minimax_m2 import MiniMaxM2Model
from akv.system.reference.oracle import Drop, OracleEvent, Repos, program_events, run_oracle, run_program


def one_token_at_a_time(model: MiniMaxM2Model, ids: list[int], events: list[OracleEvent]) -> torch.Tensor:
    """Literal DESIGN.md §1: a dict of visible token -> current position; each token computed alone."""
    layers = model.config.num_layers
    raw_k: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]
    values: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]
    visible: dict[int, int] = {}
    next_position, logits, remaining = 0, [], list(events)
    for t, token in enumerate(ids):
        while remaining and remaining[0].at == t:
            event = remaining.pop(0)
            if isinstance(event, Drop):
                for s in event.tokens:
                    visible.pop(s, None)
            else:
                visible = {s: i for i, s in enumerate(sorted(visible))}
                next_position = len(visible)
        position, next_position = next_position, next_position + 1
        hidden = model.embed(torch.tensor([token]))
        for layer in range(layers):
            inputs = model.attention_inputs(layer, hidden)
            raw_k[layer][t], values[layer][t] = inputs.k[0], inputs.v[0]
            sources = sorted(visible) + [t]
            positions = torch.tensor([visible.get(s, position) for s in sources])
            keys = model.rotate(torch.stack([raw_k[layer][s] for s in sources]), positions)
            vals = torch.stack([values[layer][s] for s in sources])
            query = model.rotate(inputs.q, torch.tensor([position]))
            hidden = model.finish_layer(layer, hidden,
                                        model.attend(query, keys, vals, torch.ones(1, len(sources), dtype=torch.bool)))
        logits.append(model.logits(hidden)[0])
        visible[t] = position
    return torch.stack(logits)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[int], list[OracleEvent]]:
    n = draw(st.integers(1, 16))
    ids = draw(st.lists(st.integers(0, 511), min_size=n, max_size=n))
    events: list[OracleEvent] = []
    for at in sorted(draw(st.lists(st.integers(0, n), max_size=5))):
        if draw(st.booleans()):
            events.append(Repos(at))
        else:
            events.append(Drop(at, tuple(draw(st.sets(st.integers(0, at - 1), max_size=at)) if at else ())))
    return ids, events


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories())
def test_blocked_oracle_equals_token_by_token_definition(
    minimax: MiniMaxM2Model, history: tuple[list[int], list[OracleEvent]]
) -> None:
    ids, events = history
    with torch.no_grad():
        expected = one_token_at_a_time(minimax, ids, events)
    torch.testing.assert_close(run_oracle(minimax, ids, events).logits, expected, atol=5e-5, rtol=0)


def transformers_staged(model_dir: Path, ids: torch.Tensor, events: list[OracleEvent]) -> torch.Tensor:
    """One transformers forward per stage over its own KV cache: hidden keys masked out with a 4-D
    additive mask; at each Repos the cached keys are re-rotated in place by the kernels' reference."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    spec = RopeSpec.from_config(json.loads((model_dir / "config.json").read_text()))
    cache = DynamicCache(config=hf.config)
    position: dict[int, int] = {}  # visible token -> current position
    next_position, done, logits = 0, 0, []
    for end in sorted({e.at for e in events} | {len(ids)}):
        if end > done:
            m = end - done
            allowed = torch.zeros(m, end, dtype=torch.bool)
            allowed[:, sorted(position)] = True
            allowed[:, done:] = torch.ones(m, m, dtype=torch.bool).tril()
            mask = torch.zeros(1, 1, m, end).masked_fill(~allowed, float("-inf"))
            positions = torch.arange(next_position, next_position + m)
            with torch.no_grad():
                out = hf(ids[None, done:end], attention_mask=mask, position_ids=positions[None],
                         past_key_values=cache, use_cache=True)
            logits.append(out.logits[0])
            position.update({done + j: int(p) for j, p in enumerate(positions)})
            next_position, done = next_position + m, end
        for event in (e for e in events if e.at == end):
            if isinstance(event, Drop):
                for t in event.tokens:
                    position.pop(t, None)
                continue
            tokens = torch.tensor(sorted(position), dtype=torch.int64)
            old, new = torch.tensor([position[int(t)] for t in tokens]), torch.arange(len(tokens))
            k = LayerBuffers.of([layer.keys[0].transpose(0, 1) for layer in cache.layers])  # views of the cache
            v = LayerBuffers.of([layer.values[0].transpose(0, 1) for layer in cache.layers])
            rerotate_kv_reference(k, v, tokens, tokens, old, new, spec)
            position = dict(zip(tokens.tolist(), new.tolist()))
            next_position = len(tokens)
    return torch.cat(logits)


EVENTS: list[OracleEvent] = [
    Drop(9, (2, 3, 4)), Repos(9), Drop(17, (11, 12)), Drop(24, (0, 20, 21)), Repos(24), Repos(30),
]


def test_oracle_equals_transformers_with_masks_and_partially_rerotated_cache(minimax_dir: Path,
                                                                             minimax: MiniMaxM2Model) -> None:
    ids = torch.randint(0, 512, (36,), generator=torch.Generator().manual_seed(12))
    expected = transformers_staged(minimax_dir, ids, EVENTS)
    result = run_oracle(minimax, ids, EVENTS)
    torch.testing.assert_close(result.log_probs(), torch.log_softmax(expected, dim=-1), atol=1e-4, rtol=0)
    unchanged = run_oracle(minimax, ids)
    assert (unchanged.logits[9:] - result.logits[9:]).abs().max() > 1e-2, "the events must matter"


PATH_ARGUMENT = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "read_file", "description": "Read a file", "parameters": PATH_ARGUMENT}}]


def _read(path: str) -> dict:
    return {"type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}


CHAT = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise a.py and b.py."},
    {"role": "assistant", "content": "", "reasoning_content": "Read both.",
     "tool_calls": [_read("a.py"), _read("b.py")]},
    {"role": "tool", "content": "def a():\n    return 1\n"},
    {"role": "tool", "content": "def b():\n    return 2\n"},
    {"role": "assistant", "content": "<think>\nBoth tiny.\n</think>\n\na returns 1, b returns 2."},
    {"role": "user", "content": "Now only b.py matters."},
]


def test_compiled_tool_chat_with_drop_and_reposition(minimax_dir: Path, minimax: MiniMaxM2Model) -> None:
    """Drop both tool results after the answer, reposition there and again after the last user turn."""
    tokenizer = AutoTokenizer.from_pretrained(minimax_dir)
    prov = prompt_provenance(tokenizer, copy.deepcopy(CHAT), tools=TOOLS)
    program = compile_program(prov.token_ids, prov.owners, parse_rules({"5": [3, 4]}, [5, 6], len(CHAT)), len(CHAT))
    header = int((prov.owners == 3).nonzero()[0][0])
    assert tokenizer.decode(prov.token_ids[header:header + 2].tolist()) == "]~b]tool"
    dropped = {t for event in program_events(program) if isinstance(event, Drop) for t in event.tokens}
    assert dropped == set((prov.owners == 3).nonzero()[0].tolist()) | set((prov.owners == 4).nonzero()[0].tolist())
    ids = torch.tensor(program.token_ids, dtype=torch.int64)
    expected = transformers_staged(minimax_dir, ids, program_events(program))
    result = run_program(minimax, program)
    torch.testing.assert_close(result.log_probs(), torch.log_softmax(expected, dim=-1), atol=1e-4, rtol=0)
    assert program.next_position == len(ids) - len(dropped)
