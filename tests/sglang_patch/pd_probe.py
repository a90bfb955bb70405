"""Run context requests through the PD hooks of the patched SGLang, on the CPU, one process.

Run with the patched site and the repository on ``PYTHONPATH``; reads a JSON job on stdin (a list of
conversations: ``messages`` as token lists, ``drops``, ``repositions``) and prints one JSON line.

Each turn is prefilled on a simulated prefill server (``tests/sglang_patch/test_disaggregation.py``:
the adapter's AkvRequest over a cache core, every slot's content a brute-force label), then handed to
SGLang's own code: ``PrefillBootstrapQueue.finalize_bootstrap`` and the scheduler's ``send_kv_chunk``
on a real ``Req`` and real ``MetadataBuffers``, with a recording transfer sender and copy executor; the
metadata row is copied to the decode side's buffers as the transfer engine copies it; on the decode
side the request is attached (``scheduling.attach``), pre-allocated by ``DecodePreallocQueue._pre_alloc``
on a real ``DecodeReqToTokenPool`` and token allocator, its receive indices taken as ``pop_preallocated``
takes them, each sent page's label copied into the receiving slot, the transfer committed by
``DecodeTransferQueue._commit_transfer_to_req``, and its decode steps' positions computed as the
patched ``ForwardBatch`` computes them. The report holds what each step produced next to the
brute-force expectation; the test asserts.
"""

from __future__ import annotations

import json
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cpu_shim  # noqa: E402

cpu_shim.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.decode import (  # noqa: E402
    DecodePreallocQueue,
    DecodeReqToTokenPool,
    DecodeTransferQueue,
)
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin  # noqa: E402
from sglang.srt.disaggregation.utils import MetadataBuffers  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import clamp_position  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from akv.system.adapter import pd_decode, usage  # noqa: E402
from akv.system.adapter.context_request import AkvRequest  # noqa: E402
from akv.system.adapter.scheduling import attach  # noqa: E402
from akv.system.context.compiler import append_generated  # noqa: E402
from akv.system.context.wire import encode_program  # noqa: E402
from tests.cache.brute import Interner, SimulatedKV, brute_layout  # noqa: E402
from tests.cache.conversations import Conversation  # noqa: E402
from tests.sglang_patch.test_disaggregation import POOL, _core, _prefill  # noqa: E402

FIRST_TOKEN = 11
DECODE_SLOTS = 512
CONTEXT_LEN = 256


class Sender:
    """SGLang's KV sender as the prefill hooks drive it: what was initialised and sent."""

    def __init__(self) -> None:
        self.pages: list[int] | None = None
        self.init_pages: int | None = None
        self.sends = 0

    def pop_decode_prefix_len(self) -> int:
        return 0

    def init(self, num_pages: int, aux_index: int | None = None) -> None:
        self.init_pages = num_pages

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return True

    def send(self, pages: np.ndarray, state_indices: list) -> None:
        self.sends += 1
        self.pages = [int(p) for p in pages]


class Executor:
    """The KV pool's re-rotation executor: the copies it was asked to run."""

    def __init__(self) -> None:
        self.runs: list[dict[str, list[int]]] = []

    def run(self, copies) -> None:
        names = ("src", "dst", "old_positions", "new_positions")
        self.runs.append({name: getattr(copies, name).tolist() for name in names})


def prefill_scheduler(buffers: MetadataBuffers, executor: Executor) -> SimpleNamespace:
    runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(device="cpu", akv_copy_executor=executor))
    kv_manager = SimpleNamespace(kv_args=SimpleNamespace(state_types=[]))
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1), disagg_metadata_buffers=buffers,
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=kv_manager),
        tp_worker=SimpleNamespace(model_runner=runner))


def decode_queues(buffers: MetadataBuffers,
                  window: int | None = None) -> tuple[DecodePreallocQueue, DecodeTransferQueue]:
    pool = DecodeReqToTokenPool(8, CONTEXT_LEN, "cpu", False, 8)
    allocator = TokenToKVPoolAllocator(DECODE_SLOTS, torch.float32, "cpu", None, False)
    scheduler = SimpleNamespace(server_args=SimpleNamespace(disaggregation_decode_enable_radix_cache=False,
                                                            disaggregation_transfer_backend="mooncake"),
                                enable_hisparse=False, enable_decode_hicache=False, sliding_window_size=window)
    prealloc = object.__new__(DecodePreallocQueue)
    prealloc.req_to_token_pool, prealloc.token_to_kv_pool_allocator, prealloc.scheduler = pool, allocator, scheduler
    prealloc.token_to_kv_pool = SimpleNamespace()
    prealloc.kv_manager = SimpleNamespace(kv_args=SimpleNamespace(state_types=[]))
    scheduler.disagg_decode_prealloc_queue = prealloc
    transfer = object.__new__(DecodeTransferQueue)
    transfer.metadata_buffers, transfer.scheduler = buffers, scheduler
    transfer.spec_algorithm = SpeculativeAlgorithm.NONE
    return prealloc, transfer


def decode_server_args() -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=False,
                           radix_cache_backend=None, chunked_prefill_size=16)


def receive(prealloc: DecodePreallocQueue, transfer: DecodeTransferQueue, req: Req, room: int) -> list[int]:
    """The decode side from pre-allocation to the committed transfer; the receiving indices."""
    prealloc._pre_alloc(req)
    receiving = prealloc.req_to_token_pool.req_to_token[req.req_pool_idx][: prealloc._rebootstrap_prefill_len(req)]
    decode_req = SimpleNamespace(req=req, metadata_buffer_index=0, kv_receiver=SimpleNamespace(clear=lambda: None),
                                 is_rebootstrap=False, hicache_restore_status=None, prefix_match=None)
    transfer.metadata_buffers.bootstrap_room[0] = room
    transfer._commit_transfer_to_req(decode_req)
    return [int(s) for s in receiving]


def decode_req(program, rid: str, data: bytes) -> tuple[Req, str | None]:
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", program.token_ids.tolist()),
              sampling_params=SamplingParams(max_new_tokens=8))
    req.bootstrap_room = 1 + len(rid)
    error = attach(req, SimpleNamespace(context_program=data), decode_server_args(), DECODE_SLOTS, CONTEXT_LEN)
    return req, error


def run_turn(core, free, kv, conv, turn, intern, n: int) -> dict:
    state, _ = _prefill(core, free, kv, conv, turn, intern)
    program = conv.program(turn)
    req = Req(rid=f"p{n}", origin_input_text="", origin_input_ids=array("q", program.token_ids.tolist()),
              sampling_params=SamplingParams(max_new_tokens=1))
    req.akv, req.metadata_buffer_index, req.pending_bootstrap = state, 0, True
    req.disagg_kv_sender = sender = Sender()
    req.output_ids.append(FIRST_TOKEN)
    req.cached_tokens = state.first_usage.cached_tokens
    PrefillBootstrapQueue.finalize_bootstrap(
        SimpleNamespace(ensure_metadata_buffer=lambda r: True, token_to_kv_pool=SimpleNamespace(page_size=1)), req)
    prefill_buffers = MetadataBuffers(1, hidden_size=8, hidden_states_dtype=torch.float32)
    prefill_buffers.cached_tokens[0] = 99  # an earlier request's row
    executor = Executor()
    scheduler = prefill_scheduler(prefill_buffers, executor)
    req.extend_range = None
    SchedulerDisaggregationPrefillMixin.send_kv_chunk(scheduler, req, last_chunk=False)
    SchedulerDisaggregationPrefillMixin.send_kv_chunk(scheduler, req, last_chunk=False, end_idx=program.n_tokens)
    middle_sends = sender.sends
    SchedulerDisaggregationPrefillMixin.send_kv_chunk(scheduler, req, last_chunk=True)
    terminal = state.active.resolved_plan().terminal.copies
    brute = brute_layout(program, intern)
    expected_columns = [list(brute.terminal[t]) for t in sorted(brute.terminal)]
    sent_columns = [list(kv.content[p]) for p in sender.pages]

    decode_buffers = MetadataBuffers(1, hidden_size=8, hidden_states_dtype=torch.float32)
    for name in ("output_ids", "cached_tokens"):  # the transfer engine copies the row
        getattr(decode_buffers, name)[0] = getattr(prefill_buffers, name)[0]
    prealloc, transfer = decode_queues(decode_buffers)
    dreq, error = decode_req(program, f"d{n}", encode_program(program))
    assert error is None, error
    receiving = receive(prealloc, transfer, dreq, dreq.bootstrap_room)
    received = {slot: sent_columns[i] for i, slot in enumerate(receiving)}
    row = prealloc.req_to_token_pool.req_to_token[dreq.req_pool_idx][: len(receiving)]
    row_columns = [received[int(s)] for s in row]

    reply = conv.reply(turn)
    full = brute_layout(append_generated(program, reply), intern)
    positions, expected_positions = [], []
    for j in range(reply.size):
        seq_len = len(dreq.origin_input_ids) + j + 1  # after prepare_for_decode: the new token's column + 1
        step = SimpleNamespace(reqs=[dreq])
        positions.append(int(pd_decode.decode_positions(step, clamp_position(torch.tensor([seq_len])))[0]))
        expected_positions.append(int(full.birth[program.n_tokens + j]))
    state.release(core, publish=True)
    return {
        "visible": int(np.count_nonzero(program.keep)), "n_tokens": program.n_tokens,
        "init_pages": sender.init_pages, "middle_sends": middle_sends, "sends": sender.sends,
        "sent_columns": sent_columns, "expected_columns": expected_columns,
        "copies_run": executor.runs,
        "terminal_copies": {name: [int(v) for v in getattr(terminal, name)]
                            for name in ("src", "dst", "old_positions", "new_positions")},
        "prefill_row": prefill_buffers.cached_tokens[0].tolist(),
        "prefill_usage": state.first_usage.as_dict(),
        "decode_input_ids": list(dreq.origin_input_ids), "kept_ids": program.token_ids[program.keep].tolist(),
        "decode_allocated": dreq.kv_committed_len, "receiving": receiving,
        "extend_range": [dreq.extend_range.start, dreq.extend_range.end],
        "row_columns": row_columns,
        "decode_output_ids": list(dreq.output_ids), "decode_finished": repr(dreq.finished_reason),
        "decode_details": usage.cached_tokens_details(dreq), "decode_prompt_tokens": usage.prompt_tokens(dreq),
        "decode_cached_tokens": dreq.cached_tokens,
        "positions": positions, "expected_positions": expected_positions,
        "decode_slots_taken": DECODE_SLOTS - prealloc.token_to_kv_pool_allocator.available_size(),
    }


def refusals(conv: Conversation, turn: int) -> dict:
    """What the decode side does when the row is not this program's: another program's layout (the
    prefill server compiled other ops), a plain request's row (no AKV prefill server); and with this
    program's row on a model with a sliding window (the send list carries no window state)."""
    kv = SimulatedKV()
    core, free = _core(POOL, kv)
    state, send = _prefill(core, free, kv, conv, turn, Interner())
    out = {}
    other = conv.without_ops_from(0).program(turn)
    cases = (("other_program", lambda b: send.metadata.write(b.cached_tokens[0]), None),
             ("plain_row", lambda b: None, None),
             ("sliding_window", lambda b: send.metadata.write(b.cached_tokens[0]), 128))
    for name, row_of, window in cases:
        buffers = MetadataBuffers(1, hidden_size=8, hidden_states_dtype=torch.float32)
        buffers.output_ids[0][0] = FIRST_TOKEN
        row_of(buffers)
        prealloc, transfer = decode_queues(buffers, window)
        program = other if name == "other_program" else conv.program(turn)
        dreq, error = decode_req(program, name, encode_program(program))
        assert error is None, error
        receive(prealloc, transfer, dreq, dreq.bootstrap_room)
        reason = dreq.finished_reason
        out[name] = {"aborted": isinstance(reason, FINISH_ABORT),
                     "status": int(reason.status_code) if isinstance(reason, FINISH_ABORT) else None,
                     "message": reason.message if isinstance(reason, FINISH_ABORT) else None,
                     "details": usage.cached_tokens_details(dreq)}
    state.release(core, publish=False)
    return out


def plain_send() -> dict:
    """A plain request through ``send_kv_chunk`` (stock path) on a metadata row an earlier context
    request wrote: its prompt's slots, and the row without context columns."""
    buffers = MetadataBuffers(1, hidden_size=8, hidden_states_dtype=torch.float32)
    buffers.cached_tokens[0, 7:14] = torch.arange(1, 8, dtype=torch.int32)
    scheduler = prefill_scheduler(buffers, Executor())
    scheduler.req_to_token_pool = SimpleNamespace(req_to_token=torch.arange(100, 140, dtype=torch.int32).reshape(2, 20))
    req = Req(rid="plain", origin_input_text="", origin_input_ids=array("q", range(6)),
              sampling_params=SamplingParams(max_new_tokens=1))
    req.metadata_buffer_index, req.req_pool_idx, req.start_send_idx = 0, 1, 0
    req.disagg_kv_sender = sender = Sender()
    req.output_ids.append(FIRST_TOKEN)
    req.set_extend_range(0, 6)
    SchedulerDisaggregationPrefillMixin.send_kv_chunk(scheduler, req, last_chunk=True)
    return {"pages": sender.pages, "row": buffers.cached_tokens[0].tolist()}


def capacity(conv: Conversation) -> dict:
    """SGLang's prefill-side check of a prompt's length against the pool, for a text one slot longer
    than the pool: a plain request is refused; a context request is not (its need, which may be smaller
    than its text, was checked when it arrived)."""
    program = conv.program(conv.n_turns - 1)
    queue = SimpleNamespace(max_total_num_tokens=program.n_tokens - 1,
                            scheduler=SimpleNamespace(output_streamer=SimpleNamespace(stream_output=lambda *a: None)))
    out = {}
    for name in ("plain", "context"):
        req = Req(rid=name, origin_input_text="", origin_input_ids=array("q", program.token_ids.tolist()),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.akv = AkvRequest(program) if name == "context" else None
        out[name] = PrefillBootstrapQueue._check_if_req_exceed_kv_capacity(queue, req)
    return out


def main() -> None:
    job = json.loads(sys.stdin.read())
    turns = []
    for case in job["conversations"]:
        conv = Conversation(tuple(tuple(m) for m in case["messages"]),
                            {int(a): tuple(ms) for a, ms in case["drops"].items()}, tuple(case["repositions"]))
        kv = SimulatedKV()
        core, free = _core(POOL, kv)
        intern = Interner()
        for turn in range(conv.n_turns):
            for _ in range(2):  # the repeat reuses (and may re-rotate) what the first published
                turns.append(run_turn(core, free, kv, conv, turn, intern, len(turns)))
        core.flush()
        turns[-1]["prefill_pool_free"] = core.pool.n_free == core.pool.size and not kv.content
    first = job["conversations"][0]
    conv = Conversation(tuple(tuple(m) for m in first["messages"]),
                        {int(a): tuple(ms) for a, ms in first["drops"].items()}, tuple(first["repositions"]))
    print(json.dumps({"turns": turns, "refusals": refusals(conv, conv.n_turns - 1), "plain": plain_send(),
                      "capacity": capacity(conv)}))


if __name__ == "__main__":
    main()
