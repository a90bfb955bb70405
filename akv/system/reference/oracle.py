"""The semantic oracle: DESIGN.md §1 computed directly, stage by stage, in FP32.

Definition. Tokens ``x_0 .. x_{n-1}`` are appended in order. Events sit between tokens: an event with
``at = a`` applies after ``a`` tokens have been appended. The *stage* is the number of events applied
so far. A token ``t`` appended at stage ``g``:

- has its hidden states computed once, at append time, and never again;
- queries with RoPE position ``p(t)``, the next free position when it is appended;
- attends to itself and to every earlier token ``s`` that no Drop applied before ``t`` has hidden, with
  key ``R(pos_g(s)) K_raw(s)``: the post-norm, un-rotated key computed when ``s`` was appended, rotated
  to the position ``s`` holds at stage ``g``;
- reads values ``V(s)`` as computed at append time (values are never rotated).

On a sliding-window layer of width ``W`` (gpt-oss) the query at position ``p(t)`` reads only the
visible keys whose position at stage ``g`` is greater than ``p(t) - W``; a model's ``attend_layer``
applies that (and any per-head sink logits).

``Drop(at, tokens)`` hides ``tokens`` (all ``< at``) from every later query; positions do not change.
``Repos(at)`` gives the ``r`` tokens still visible positions ``0 .. r-1`` in token order; the next
append continues at ``r``. Events at one ``at`` apply in the order given.

Nothing here reads the compiler's positions: ``run_program`` uses only a program's token ids and events.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from akv.system.context.program import ContextProgram, EventKind
from akv.system.reference.model import ReferenceModel


@dataclass(frozen=True)
class Drop:
    """Hide ``tokens`` (indices ``< at``) from every query appended after ``at`` tokens."""

    at: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Repos:
    """After ``at`` tokens, give the visible tokens positions ``0 .. r-1``; the next append is at ``r``."""

    at: int


OracleEvent = Drop | Repos


@dataclass(frozen=True)
class Layout:
    """Positions and visibility implied by the events alone (int64 tensors, ``n`` = token count).

    ``stage_positions[g, t]`` is the position of ``t`` during stage ``g``, or -1 where ``t`` is not yet
    appended or is hidden; ``visible_until[t]`` is the first query index that no longer sees ``t``
    (``n`` when none in the sequence); ``final_position`` is -1 for hidden tokens."""

    n_tokens: int
    birth_position: torch.Tensor
    birth_stage: torch.Tensor
    stage_positions: torch.Tensor
    visible_until: torch.Tensor
    final_position: torch.Tensor
    next_position: int

    @property
    def keep(self) -> torch.Tensor:
        """Tokens no Drop has hidden (the keys a continuation would still read)."""
        return self.final_position >= 0

    @property
    def n_stages(self) -> int:
        return int(self.stage_positions.shape[0])


@dataclass(frozen=True)
class OracleResult:
    """Per-token logits plus, per layer, the raw (post-norm, un-rotated) keys and the values."""

    token_ids: torch.Tensor
    logits: torch.Tensor
    raw_k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    layout: Layout

    def log_probs(self) -> torch.Tensor:
        """``[n, vocab]`` log-softmax of the logits."""
        return torch.log_softmax(self.logits.to(torch.float32), dim=-1)

    def keys_at(self, model: ReferenceModel, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Keys of every token of ``layer`` rotated to ``positions[n]`` (as a cache would store them)."""
        return model.rotate(self.raw_k[layer], positions)

    def final_kv(self, model: ReferenceModel, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a cache must hold for ``layer`` after the last event: the kept tokens, their keys
        rotated to their final positions, and their values."""
        kept = self.layout.keep.nonzero().flatten().to(self.raw_k[layer].device)
        keys = model.rotate(self.raw_k[layer][kept], self.layout.final_position[kept])
        return kept, keys, self.v[layer][kept]


def simulate_layout(n_tokens: int, events: Sequence[OracleEvent]) -> Layout:
    """Walk the tokens one by one, applying each event when its ``at`` is reached."""
    _check_events(n_tokens, events)
    position = [-1] * n_tokens
    birth_position = [0] * n_tokens
    birth_stage = [0] * n_tokens
    visible_until = [n_tokens] * n_tokens
    snapshots: list[list[int]] = []
    next_position = 0
    pending = [Drop(int(e.at), tuple(int(t) for t in e.tokens)) if isinstance(e, Drop) else Repos(int(e.at))
               for e in events]
    for t in range(n_tokens + 1):
        while pending and pending[0].at == t:
            event = pending.pop(0)
            snapshots.append(list(position))
            if isinstance(event, Drop):
                for s in event.tokens:
                    if position[s] >= 0:
                        position[s] = -1
                        visible_until[s] = event.at
            else:
                survivors = [s for s in range(t) if position[s] >= 0]
                for new, s in enumerate(survivors):
                    position[s] = new
                next_position = len(survivors)
        if t == n_tokens:
            break
        position[t] = birth_position[t] = next_position
        birth_stage[t] = len(snapshots)
        next_position += 1
    snapshots.append(list(position))
    return Layout(
        n_tokens=n_tokens,
        birth_position=_int64(birth_position),
        birth_stage=_int64(birth_stage),
        stage_positions=_int64(snapshots).reshape(len(snapshots), n_tokens),
        visible_until=_int64(visible_until),
        final_position=_int64(position),
        next_position=next_position,
    )


def _int64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_events(n_tokens: int, events: Sequence[OracleEvent]) -> None:
    previous = 0
    for index, event in enumerate(events):
        if not isinstance(event, (Drop, Repos)):
            raise TypeError(f"events[{index}] must be Drop or Repos, got {type(event).__name__}")
        if not _is_int(event.at) or not 0 <= event.at <= n_tokens:
            raise ValueError(f"events[{index}].at must be an int in [0, {n_tokens}], got {event.at!r}")
        if event.at < previous:
            raise ValueError(f"events[{index}].at must not decrease, got {event.at} after {previous}")
        previous = event.at
        if isinstance(event, Drop):
            for token in event.tokens:
                if not _is_int(token) or not 0 <= token < event.at:
                    raise ValueError(f"events[{index}].tokens must be ints in [0, {event.at}), got {token!r}")


def run_oracle(
    model: ReferenceModel, token_ids: Sequence[int] | torch.Tensor, events: Sequence[OracleEvent] = ()
) -> OracleResult:
    """Compute every token's logits, raw keys and values under ``events`` (see the module docstring).

    Tokens of one stage are computed as a block: inside a stage no position or visibility changes, so
    a block with a causal mask is the same computation as appending its tokens one at a time."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
    n = int(ids.shape[0])
    layout = simulate_layout(n, events)
    c, device = model.config, model.device
    raw_k = [torch.zeros(n, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=device) for _ in range(c.num_layers)]
    values = [torch.zeros(n, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=device) for _ in range(c.num_layers)]
    logits = torch.zeros(n, c.vocab_size, dtype=torch.float32, device=device)
    with torch.no_grad():
        for stage in range(layout.n_stages):
            block = (layout.birth_stage == stage).nonzero().flatten()
            if block.numel() == 0:
                continue
            start, end = int(block[0]), int(block[-1]) + 1
            earlier = (layout.stage_positions[stage, :start] >= 0).nonzero().flatten()
            key_positions = torch.cat((layout.stage_positions[stage, earlier],
                                       layout.birth_position[start:end])).to(device)
            query_positions = layout.birth_position[start:end].to(device)
            m = end - start
            visible = torch.cat((torch.ones(m, earlier.numel(), dtype=torch.bool),
                                 torch.ones(m, m, dtype=torch.bool).tril()), dim=1).to(device)
            earlier = earlier.to(device)
            hidden = model.embed(ids[start:end])
            for layer in range(c.num_layers):
                inputs = model.attention_inputs(layer, hidden)
                raw_k[layer][start:end] = inputs.k
                values[layer][start:end] = inputs.v
                keys = model.rotate(torch.cat((raw_k[layer][earlier], inputs.k)), key_positions)
                attention = model.attend_layer(layer, model.rotate(inputs.q, query_positions), keys,
                                               torch.cat((values[layer][earlier], inputs.v)), visible,
                                               query_positions, key_positions)
                hidden = model.finish_layer(layer, hidden, attention)
            logits[start:end] = model.logits(hidden).to(torch.float32)
    return OracleResult(token_ids=ids, logits=logits, raw_k=tuple(raw_k), v=tuple(values), layout=layout)


def program_events(program: ContextProgram) -> list[OracleEvent]:
    """The oracle's events for a compiled program: only each event's kind, ``at`` and drop ranges."""
    events: list[OracleEvent] = []
    for index, event in enumerate(program.events):
        if event.kind == EventKind.DROP:
            tokens = tuple(t for start, end in event.ranges for t in range(int(start), int(end)))
            events.append(Drop(at=int(event.at), tokens=tokens))
        elif event.kind == EventKind.REPOS:
            events.append(Repos(at=int(event.at)))
        else:
            raise ValueError(f"program.events[{index}].kind must be DROP or REPOS, got {event.kind!r}")
    return events


def run_program(model: ReferenceModel, program: ContextProgram) -> OracleResult:
    """Run the oracle on a compiled program's token ids and events; positions are recomputed here."""
    return run_oracle(model, torch.tensor(program.token_ids, dtype=torch.int64), program_events(program))
