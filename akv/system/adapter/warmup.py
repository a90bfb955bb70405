"""Warm-up of the context path during SGLang's own warm-up, so that a server's first context request
costs what later ones do:

- :func:`warm_kernels` (scheduler process, after CUDA graph capture): the re-rotation kernel runs
  once in every launch shape a copy list can take on this model's KV pool, over every layer (a
  decode step's copies) and over one layer (an extend forward's, run per layer between its KV write
  and its attention), as in-place copies at unchanged positions, which write nothing;
- :func:`warm_context_requests` (HTTP server, after SGLang's warm-up request): a short conversation,
  its next turn with a Drop and a Repos (copies, index lists, extend and decode), and a cold request
  whose Drop splits it into several segments (attention entries of one forward);
- :data:`SHAPES` counts launches of AKV's Triton kernels in a specialization not launched before in
  this process (Triton compiles one kernel per specialization), reported as the metric
  ``sglang:akv_kernel_first_launches_total``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import requests
import torch
import triton

from akv.system.adapter.copy_executor import CopyBatch, CopyExecutor
from akv.system.kernels import kv_indices, rerotate
from akv.system.kernels.launch_device import check_launchable
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import RerotateLaunch, rerotate_kv

logger = logging.getLogger(__name__)

KERNELS = (rerotate._rerotate_kernel, kv_indices._count_columns_kernel, kv_indices._fill_columns_kernel,
           kv_indices._fill_gaps_kernel)
"""AKV's Triton kernels: those a context request launches."""


def _runtime_class(value: Any) -> Any:
    """What Triton specializes a runtime argument on: a tensor's dtype (and on CUDA whether its
    address is 16-byte aligned), an int's width and whether it is 1 or a multiple of 16."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.is_cuda and value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, int):
        return "int", value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    return type(value).__name__


class LaunchShapes:
    """Specializations launched so far per kernel; ``first_launches`` counts the launches that were
    the first of their specialization. ``on_first`` is told of each."""

    def __init__(self) -> None:
        self.seen: set[tuple[Any, ...]] = set()
        self.first_launches = 0
        self.on_first: Callable[[], None] | None = None
        self._installed = False

    def install(self) -> None:
        """Watch every kernel of :data:`KERNELS` (once per process)."""
        if self._installed:
            return
        self._installed = True
        for kernel in KERNELS:
            kernel.add_pre_run_hook(self._hook(kernel.__name__))

    def _hook(self, name: str) -> Callable[..., None]:
        def seen(*args: Any, **kwargs: Any) -> None:
            key = (name, tuple(_runtime_class(a) for a in args), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
            if key not in self.seen:
                self.seen.add(key)
                self.first_launches += 1
                if self.on_first is not None:
                    self.on_first()

        return seen


SHAPES = LaunchShapes()


def copy_counts(k: LayerBuffers) -> list[int]:
    """Copy-list lengths covering every specialization of the re-rotation kernel on ``k`` (its launch
    shape, and whether the count is 1 or a multiple of 16), each below the pool's slot count."""
    limit = k.n_slots - 1
    by_class: dict[tuple[RerotateLaunch, bool, bool], int] = {}
    for n in _candidates(k, limit):
        by_class.setdefault((RerotateLaunch.default(n, k), n == 1, n % 16 == 0), n)
    return sorted(by_class.values())


def _candidates(k: LayerBuffers, limit: int) -> Iterator[int]:
    """For each run of copy blocks sharing a launch shape: its first counts and its first multiple of 16."""
    block = RerotateLaunch.default(1, k).block_copies
    previous = None
    for blocks in range(1, triton.cdiv(limit, block) + 1):
        launch = RerotateLaunch.default(blocks * block, k)
        if launch != previous:
            first = (blocks - 1) * block + 1
            yield from (n for n in (first, first + 1, triton.cdiv(first, 16) * 16) if n <= limit)
            previous = launch


def warm_kernels(model_runner: Any) -> int:
    """Launch the re-rotation kernel in each of its specializations on ``model_runner``'s KV pool, over
    all layers and over one (writing nothing), and watch AKV's kernels from now on; returns the launches made (0 when the
    server does not use the AKV cache or the model has no RoPE to re-rotate)."""
    SHAPES.install()
    if getattr(model_runner.server_args, "radix_cache_backend", None) != "akv":
        return 0
    if not hasattr(model_runner.token_to_kv_pool, "k_buffer"):
        return 0  # a pool the AKV cache refuses at start-up (hybrid SWA memory), naming the flag to use
    try:
        executor = CopyExecutor(model_runner)
        check_launchable(executor.k.base, "k_buffer")
    except ValueError as exc:
        logger.info("AKV warm-up: no re-rotation kernel to warm (%s)", exc)
        return 0
    counts = copy_counts(executor.k)
    per_layer = copy_counts(executor.layer(0)[0])
    device = executor.k.base.device
    for n in sorted({*counts, *per_layer}):
        slots = torch.arange(1, n + 1, dtype=torch.int64, device=device)
        positions = torch.zeros(n, dtype=torch.int64, device=device)
        if n in counts:
            rerotate_kv(executor.k, executor.v, slots, slots, positions, positions, executor.rope, validate=False)
        if n in per_layer:
            executor.run_layer(0, CopyBatch(slots, slots, positions, positions))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("AKV warm-up: re-rotation kernel launched for copy counts %s (all layers), %s (one layer)",
                counts, per_layer)
    return len(counts) + len(per_layer)


WARMUP_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Here are some notes to keep in mind: " + "apples pears plums cherries " * 8},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "Name a fruit from the notes."},
]


def context_bodies(model: str) -> list[dict[str, Any]]:
    """The warm-up requests, in order: the conversation plain, its next turn dropping the notes and
    repositioning, and a cold variant whose Drop at message 3 splits the prefill into rounds."""
    common = {"model": model, "temperature": 0, "max_tokens": 4}
    turn = WARMUP_MESSAGES
    nxt = turn + [{"role": "assistant", "content": "Apples."}, {"role": "user", "content": "And a colour?"}]
    last = len(nxt) - 1
    cold = [dict(m, content=f"{m['content']} (again)") for m in nxt]
    return [
        {**common, "messages": turn},
        {**common, "messages": nxt, "drop_message": {str(last): [3, 4]}, "reposition": [last]},
        {**common, "messages": cold, "drop_message": {"3": [1, 2], str(last): [3]}, "reposition": [last]},
    ]


def warm_context_requests(server_args: Any, url: str, headers: dict[str, str], verify: Any) -> int:
    """Send :func:`context_bodies` to the server at ``url`` (SGLang's warm-up, before it reports
    ready); raises naming the request and the server's answer when one fails. Returns the requests
    sent (0 when the server does not serve context requests: another cache, or no tokenizer)."""
    if server_args.radix_cache_backend != "akv" or server_args.skip_tokenizer_init:
        return 0
    bodies = context_bodies(server_args.served_model_name)
    for body in bodies:
        res = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=600, verify=verify)
        if res.status_code != 200:
            raise RuntimeError(f"AKV warm-up request {json.dumps(body)[:300]} answered {res.status_code}: "
                               f"{res.text[:500]}")
    return len(bodies)
