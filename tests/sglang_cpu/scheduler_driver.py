"""Serve requests through SGLang 0.5.16's real ``Scheduler`` + ``TpModelWorker`` on the CPU.

Run as a script (its own process: SGLang's scheduler owns a torch.distributed world) with the
patched wheel's site first on ``PYTHONPATH``; reads a JSON job on stdin and prints one JSON line,
a report per part of the job. Each part's waves meet the scheduler as a fresh one would (SGLang's
own cache flush between parts, every record started afresh), so that tests with the same scheduler
settings share one process.

The scheduler's real event loop (normal or overlap) runs in a thread and is fed over ZMQ the way
SGLang's tokenizer manager feeds it; outputs are captured where the scheduler hands them to the
detokenizer. Per request the result holds the output ids, the usage SGLang reports, and the
next-token logits of every forward that predicts a generated token (keyed by its index).

With ``audit`` on, :class:`Audit` checks every read of the AKV cache against the brute force of
``tests/cache/brute.py`` while the scheduler runs. With ``count_calls`` on, each wave's report counts
the cache core's calls during it (:class:`CoreCalls`); with ``host_clock`` on, the scheduler thread's
CPU time during it, by phase (:class:`HostClock`). With ``stub_attention`` on, the Triton backend's
attention kernels write zeros instead of attending, and SGLang writes ``req_to_token`` rows with its
torch path instead of the interpreted Triton kernel (everything else runs: scheduling, the cache core,
KV writes, re-rotation copies): for measuring the host work of long contexts, which the interpreted
kernels would take hours to attend over (and seconds to index); the outputs are then meaningless.

Test-side setup only (nothing here changes SGLang): the torchvision shim, the Triton interpreter
with its numpy scalar fix, the flag that keeps ``RotaryEmbedding`` off vllm's CPU kernel, and
MiniMax-M2's QK norm on the CPU (``cpu_models``).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "sglang_patch"))
sys.path.insert(0, str(HERE.parent / "cache"))

import cpu_shim  # noqa: E402
import flashinfer_probe  # noqa: E402

from bench.harness.servers import CPU_KV_SPLITS  # noqa: E402

JOB = json.loads(sys.stdin.read())
os.environ.update({key: str(value) for key, value in JOB.get("env", {}).items()})  # before SGLang reads them
os.environ["TRITON_INTERPRET"] = "1"
cpu_shim.install()


def _fix_triton_interpreter() -> None:
    """Triton 3.6's interpreter with numpy >= 2.4: a loaded scalar used as a loop bound is a
    one-element array, which ``range`` rejects; give interpreted tensors an ``__index__``."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


_fix_triton_interpreter()

import zmq  # noqa: E402

import sglang.srt.layers.rotary_embedding.base as rotary_base  # noqa: E402

rotary_base._is_cpu = True  # RotaryEmbedding.forward_native instead of vllm's CPU kernel

import cpu_models  # noqa: E402

cpu_models.install()  # MiniMax-M2's QK norm without its CUDA-only wrappers

from sglang.srt.managers.io_struct import (  # noqa: E402
    AbortReq, FlushCacheReqInput, FlushCacheReqOutput, TokenizedGenerateReqInput, sock_send)
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs, set_global_server_args_for_scheduler  # noqa: E402


class Audit:
    """Shadow contents of the KV pool, as brute-force labels (token, history, position): every slot a
    finished context request's plan read, and every prefix slot a plain request published over, must
    hold the KV of the request's own event history; SGLang's allocator must never hand out or free a
    slot the cache core still holds. Violations raise inside the scheduler (the run fails). A context
    request that gave births back mid-request (issue #30) cannot be replayed at its end (their slots
    went on to other KV): its published versions are labelled instead, each a slot it still holds, and
    its own reads are left to the oracle's exactness and later requests' reads to the audit."""

    def __init__(self, scheduler: Any) -> None:
        import numpy as np
        from brute import Interner, SimulatedKV, brute_layout

        from akv.system.context.compiler import append_generated, compile_program
        from akv.system.context.rules import parse_rules

        self.np, self.brute_layout, self.append_generated = np, brute_layout, append_generated
        self.plain_program = lambda ids: compile_program(ids, np.zeros(ids.size, dtype=np.int64),
                                                          parse_rules(None, None, 1), 1)
        self.kv, self.intern = SimulatedKV(), Interner()
        self.counts = {"context_plans": 0, "plain_publications": 0, "allocations": 0, "frees": 0, "evicted": 0,
                       "recycled_plans": 0}
        cache = scheduler.tree_cache
        self.core, self.pool = cache.core, cache.core.pool
        self.pool._on_free = self.kv.forget
        finish, publish = self.core.finish, cache._publish_plain
        allocator = cache.token_to_kv_pool_allocator
        alloc, free = allocator.alloc, allocator.free
        self.core.finish = lambda request, ids=None, slots=None: (self._finish(request, ids, slots),
                                                                  finish(request, ids, slots))
        cache._publish_plain = lambda req, row, is_insert: (self._publish(req, row), publish(req, row, is_insert))[1]
        evict = cache.evict
        cache.evict = lambda params: self._evicted(evict(params))
        allocator.alloc = lambda *a, **k: self._allocated(alloc(*a, **k))
        allocator.free = lambda slots: (self._freed(slots), free(slots))

    def _finish(self, request: Any, ids: Any, slots: Any) -> None:
        brute = self.brute_layout(request.program, self.intern)
        plan = request.resolved_plan()
        if request.freed.any():  # births recycled mid-request: a replay at the end cannot reuse their slots
            from akv.system.cache.core import _own_versions

            tokens, positions, held = _own_versions(request, plan, self.np.zeros(0, "int64"))
            assert (self.pool.refcount(held) > 0).all(), "a recycled request publishes a slot it gave back"
            for token, position, slot in zip(tokens.tolist(), positions.tolist(), held.tolist()):
                self.kv.content[slot] = (brute.names[token], position)
            self.counts["recycled_plans"] += 1
        else:
            self._replay(request, brute, plan)
        if slots is not None and len(slots):
            grown = self.brute_layout(self.append_generated(request.program, self.np.asarray(ids)), self.intern)
            self.kv.write_generated(self.np.asarray(slots), grown, request.program.n_tokens, self.pool)
        self.counts["context_plans"] += 1

    def _replay(self, request: Any, brute: Any, plan: Any) -> None:
        in_place = {int(s) for job in plan.copies for s, d in zip(job.src, job.dst) if s == d}
        self.kv.execute(plan, brute, self.pool, rewritable=in_place)

    def _publish(self, req: Any, row: Any) -> None:
        ids = self.np.asarray((list(req.origin_input_ids) + list(req.output_ids))[: row.size], dtype=self.np.int64)
        names = self.brute_layout(self.plain_program(ids), self.intern).names
        start = req.cache_protected_len
        for column in range(start):
            got = self.kv.content.get(int(row[column]))
            assert got == (names[column], column), f"{req.rid}: column {column} reads {got}, needs {(names[column], column)}"
        for column in range(start, row.size):
            self.kv.content[int(row[column])] = (names[column], column)
        self.counts["plain_publications"] += 1

    def _evicted(self, result: Any) -> Any:
        self.counts["evicted"] += result.num_tokens_evicted
        return result

    def _allocated(self, slots: Any) -> Any:
        if slots is not None and slots.numel():
            ids = slots.cpu().numpy().astype("int64")
            held = self.pool.refcount(ids) > 0
            assert not held.any(), f"allocator handed out slot {int(ids[held][0])}, which the cache holds"
            stale = [s for s in ids.tolist() if s in self.kv.content]
            assert not stale, f"allocator handed out slot {stale[0]} whose KV was never released by the cache"
            self.counts["allocations"] += 1
        return slots

    def _freed(self, slots: Any) -> None:
        if slots.numel():
            ids = slots.cpu().numpy().astype("int64")
            held = self.pool.refcount(ids) > 0
            assert not held.any(), f"slot {int(ids[held][0])} freed while the cache holds it"
            self.counts["frees"] += 1


class CoreCalls:
    """Counts of the cache core's ``match`` (a key matched against the tree and planned), ``commit``
    and the tree's ``match`` calls, since the last :meth:`take`."""

    NAMES = ("match", "commit")

    def __init__(self, core: Any) -> None:
        self.counts = dict.fromkeys((*self.NAMES, "tree_match"), 0)
        for name in self.NAMES:
            setattr(core, name, self._counted(name, getattr(core, name)))
        core.tree.match = self._counted("tree_match", core.tree.match)

    def _counted(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return out


class HostClock:
    """CPU milliseconds of the scheduler thread in each phase of its loop since the last :meth:`take`:
    receiving and attaching requests, picking the next batch (admission), running it and processing
    its result (release and publish). Idle passes (nothing received, no batch) are not counted."""

    PHASES = ("receive", "schedule", "run", "result")

    def __init__(self, scheduler: Any) -> None:
        self.ms = dict.fromkeys(self.PHASES, 0.0)
        receiver = scheduler.request_receiver
        receiver.recv_requests = self._timed("receive", receiver.recv_requests, lambda args, out: bool(out))
        scheduler.process_input_requests = self._timed("receive", scheduler.process_input_requests,
                                                       lambda args, out: bool(args[0]))
        scheduler.get_next_batch_to_run = self._timed("schedule", scheduler.get_next_batch_to_run,
                                                      lambda args, out: out.batch_to_run is not None)
        scheduler.run_batch = self._timed("run", scheduler.run_batch)
        scheduler.process_batch_result = self._timed("result", scheduler.process_batch_result)

    def _timed(self, phase: str, fn: Any, counted: Any = lambda args, out: True) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            out = fn(*args, **kwargs)
            if counted(args, out):
                self.ms[phase] += (time.thread_time() - start) * 1e3
            return out

        return timed

    def take(self) -> dict[str, float]:
        out, self.ms = self.ms, dict.fromkeys(self.PHASES, 0.0)
        return {k: round(v, 3) for k, v in out.items()}


def _stub_attention(backend: Any) -> None:
    """The Triton backend's extend and decode attention write zeros into their output, and
    ``req_to_token`` rows are written by SGLang's torch path (module docstring)."""
    from sglang.srt.mem_cache import allocation

    allocation.support_triton = lambda attention_backend: False

    def zeros(q: Any, k: Any, v: Any, o: Any, *args: Any, **kwargs: Any) -> None:
        o.zero_()

    def decode_zeros(q: Any, k_buffer: Any, v_buffer: Any, o: Any, *args: Any, **kwargs: Any) -> None:
        o.zero_()

    backend.extend_attention_fwd = zeros
    backend.decode_attention_fwd = decode_zeros


class PrefillLog(logging.Handler):
    """The AKV prefill lines the scheduler logs at DEBUG (one per release of a context request), as
    ``{"rid": ..., field: number}``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[dict[str, Any]] = []
        logger = logging.getLogger("akv.system.adapter.metrics")
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"AKV prefill (\S+): (.*)", record.getMessage())
        if found:
            fields = dict(re.findall(r"(\w+)=([\d.]+)", found.group(2)))
            self.lines.append({"rid": found.group(1), **{k: float(v) for k, v in fields.items()}})


class _WholeWaves:
    """SGLang's request receiver, whose ``recv_requests`` waits while the driver sends a wave."""

    def __init__(self, receiver: Any, arriving: threading.Lock) -> None:
        self._receiver = receiver
        self._arriving = arriving

    def recv_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self._arriving:
            return self._receiver.recv_requests(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._receiver, name)


class Driver:
    """One scheduler, its loop thread, the request socket and everything captured."""

    def __init__(self, model: str, overlap: bool, chunk: int, backend: str | None, max_total_tokens: int,
                 extra_args: dict[str, Any], audit: bool = False, count_calls: bool = False,
                 stub_attention: bool = False, host_clock: bool = False) -> None:
        args = ServerArgs(
            model_path=model, device="cpu", attention_backend="triton", sampling_backend="pytorch", page_size=1,
            dtype="float32", disable_cuda_graph=True, disable_overlap_schedule=not overlap,
            chunked_prefill_size=chunk, max_total_tokens=max_total_tokens, max_running_requests=8,
            skip_server_warmup=True, radix_cache_backend=backend, mem_fraction_static=0.5,
            **{"triton_attention_num_kv_splits": CPU_KV_SPLITS, **extra_args},
        )
        set_global_server_args_for_scheduler(args)
        ports = PortArgs.init_new(args)
        self.push = zmq.Context().socket(zmq.PUSH)
        self.push.bind(ports.scheduler_input_ipc_name)
        self.scheduler = Scheduler(args, ports, gpu_id=0, tp_rank=0, moe_ep_rank=0, pp_rank=0, attn_cp_rank=0,
                                   moe_dp_rank=0, dp_rank=None)
        self.outputs: list[Any] = []
        self.lock = threading.Lock()
        capture = lambda out, recv=None: self._capture(out)  # noqa: E731
        self.scheduler.ipc_channels.send_to_detokenizer.send_output = capture
        self.scheduler.ipc_channels.send_to_tokenizer.send_output = capture
        self.logits: dict[str, dict[int, list[float]]] = {}
        self.batches: list[list[str]] = []
        self.tokens: list[list[int]] = []
        self.extends: list[bool] = []
        self.prompt_len: dict[str, int] = {}
        self._record_logits()
        self.arriving = threading.Lock()
        self._receive_whole_waves()
        self.audit = Audit(self.scheduler) if audit else None
        self.calls = CoreCalls(self.scheduler.tree_cache.core) if count_calls else None
        self.clock = HostClock(self.scheduler) if host_clock else None
        if stub_attention:
            _stub_attention(self.scheduler.tp_worker.model_runner.attn_backend)
        self.prefill_log = PrefillLog()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _capture(self, out: Any) -> None:
        with self.lock:
            self.outputs.append(out)

    def _loop(self) -> None:
        try:
            self.scheduler.run_event_loop()
        except BaseException:  # noqa: BLE001 - reported to the test
            self.error = traceback.format_exc()

    def _record_logits(self) -> None:
        """Keep each forward's next-token logits per request, keyed by the generated index they
        predict (columns with KV after the forward minus the prompt length)."""
        runner = self.scheduler.tp_worker.model_runner
        forward = runner.forward
        driver = self

        def recording(forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
            out = forward(forward_batch, *args, **kwargs)
            if forward_batch.rids is not None:
                driver.batches.append(list(forward_batch.rids))
                extend = forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None
                driver.tokens.append(list(extend) if extend is not None else [1] * len(forward_batch.rids))
                driver.extends.append(extend is not None)
            logits = getattr(out.logits_output, "next_token_logits", None)
            if logits is not None and forward_batch.rids is not None:
                seq_lens = forward_batch.seq_lens_cpu.tolist()
                for i, rid in enumerate(forward_batch.rids):
                    if rid in driver.prompt_len:
                        index = seq_lens[i] - driver.prompt_len[rid]
                        if index >= 0:
                            driver.logits.setdefault(rid, {})[index] = logits[i].detach().float().tolist()
            return out

        runner.forward = recording

    def _receive_whole_waves(self) -> None:
        """The scheduler receives nothing while a wave is being sent (:meth:`submit_wave`)."""
        self.scheduler.request_receiver = _WholeWaves(self.scheduler.request_receiver, self.arriving)

    def submit_wave(self, requests: list[dict[str, Any]]) -> None:
        """Send a wave's requests so that the scheduler receives them in one step (a wave is sent at
        once: which requests share the first batch must not depend on the thread's timing)."""
        with self.arriving:
            for request in requests:
                self.submit(request)
            time.sleep(0.2)  # the socket delivers every message before the scheduler reads again

    def submit(self, request: dict[str, Any]) -> None:
        params = SamplingParams(max_new_tokens=request["max_new"], temperature=0.0, ignore_eos=True)
        params.normalize(None)
        program = request.get("program")
        self.prompt_len[request["rid"]] = len(request["ids"])
        sock_send(self.push, TokenizedGenerateReqInput(
            rid=request["rid"], input_text=None, input_ids=array("q", request["ids"]), input_embeds=None,
            mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
            context_program=None if program is None else base64.b64decode(program),
        ))

    def abort(self, rid: str) -> None:
        sock_send(self.push, AbortReq(rid=rid))

    def flush(self, timeout: float = 60) -> None:
        """SGLang's cache flush, sent as the tokenizer manager sends ``/flush_cache`` (the loop handles
        it between steps): the tree and the pools emptied; then every record (outputs, logits, batches,
        prefill log, audit counts, FlashInfer probe) starts afresh."""
        sock_send(self.push, FlushCacheReqInput())
        deadline = time.time() + timeout
        while True:
            with self.lock:
                flushed = [out for out in self.outputs if isinstance(out, FlushCacheReqOutput)]
            if flushed or self.error or time.time() > deadline:
                break
            time.sleep(0.05)
        if not flushed or not flushed[0].success:
            raise RuntimeError(self.error or f"flush refused or not answered: {flushed}; {self.state()}")
        with self.lock:
            self.outputs.clear()
        for record in (self.logits, self.prompt_len):
            record.clear()
        for log in (self.batches, self.tokens, self.extends, self.prefill_log.lines):
            log.clear()
        if self.audit is not None:
            self.audit.counts = dict.fromkeys(self.audit.counts, 0)
        flashinfer_probe.reset()

    def results(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self.lock:
            captured = list(self.outputs)
        for batch in captured:
            if isinstance(batch, AbortReq):
                out.setdefault(batch.rid, _empty())["finished"] = {"type": "abort"}
                continue
            for i, rid in enumerate(getattr(batch, "rids", [])):
                entry = out.setdefault(rid, _empty())
                ids = batch.output_ids[i] if batch.output_ids else None
                entry["ids"].extend(list(ids) if ids is not None else [])
                if batch.finished_reasons[i] is not None:
                    entry["finished"] = batch.finished_reasons[i]
                    entry["cached_tokens"] = batch.cached_tokens[i]
                    entry["details"] = batch.cached_tokens_details[i] if batch.cached_tokens_details else None
                    entry["retractions"] = batch.retraction_counts[i] if batch.retraction_counts else 0
        for rid, entry in out.items():
            entry["logits"] = {str(k): v for k, v in self.logits.get(rid, {}).items()}
        return out

    def wait(self, rids: list[str], aborts: dict[str, int], timeout: float,
             aborts_after_forwards: dict[str, int] | None = None) -> None:
        """Until ``rids`` finish and the scheduler is idle; aborting each rid of ``aborts`` once it has
        that many next-token logits, and each of ``aborts_after_forwards`` once that many forwards
        carried it."""
        deadline = time.time() + timeout
        pending_aborts = dict(aborts)
        pending_forwards = dict(aborts_after_forwards or {})
        while time.time() < deadline:
            if self.error:
                raise RuntimeError(self.error)
            results = self.results()
            for rid, after in list(pending_aborts.items()):
                if len(self.logits.get(rid, {})) >= after or after == 0:
                    self.abort(rid)
                    del pending_aborts[rid]
            for rid, after in list(pending_forwards.items()):
                if sum(rid in b for b in self.batches) >= after:
                    self.abort(rid)
                    del pending_forwards[rid]
            if all(results.get(r, {}).get("finished") for r in rids) and self._idle():
                return
            time.sleep(0.05)
        raise TimeoutError(f"requests {rids} did not finish in {timeout} s; {self.state()}")

    def state(self) -> str:
        """Where every request is (waiting, between rounds, in the chunked slot, running, finished) and
        the pool's counts: what a stalled wave is waiting for."""
        s = self.scheduler
        finished = [rid for rid, entry in self.results().items() if entry["finished"]]
        chunked = None if s.chunked_req is None else s.chunked_req.rid
        return (f"waiting {[r.rid for r in s.waiting_queue]}, between rounds "
                f"{[r.rid for r in s.akv_rounds.reqs]}, chunked {chunked}, running "
                f"{[r.rid for r in s.running_batch.reqs]} (batch_is_full {s.running_batch.batch_is_full}), "
                f"finished {finished}, forwards {len(self.batches)}, pool "
                f"{{'available': {s.token_to_kv_pool_allocator.available_size()}, "
                f"'evictable': {s.tree_cache.evictable_size()}, 'protected': {s.tree_cache.protected_size()}}}")

    def _idle(self) -> bool:
        s = self.scheduler
        return (not s.waiting_queue and s.running_batch.is_empty() and s.chunked_req is None
                and not getattr(s, "akv_rounds", None))

    def pool(self) -> dict[str, int]:
        time.sleep(0.3)  # let the loop run its idle pass (the strict leak check)
        s = self.scheduler
        return {"available": int(s.token_to_kv_pool_allocator.available_size()),
                "evictable": int(s.tree_cache.evictable_size()), "protected": int(s.tree_cache.protected_size()),
                "total": int(s.max_total_num_tokens)}


def _empty() -> dict[str, Any]:
    return {"ids": [], "finished": None, "cached_tokens": None, "details": None}


def main() -> None:
    job = JOB
    if job.get("flashinfer_probe"):
        flashinfer_probe.install()
    started = time.time()
    driver = Driver(job["model"], job["overlap"], job["chunk"], job["backend"], job.get("max_total_tokens", 4096),
                    job.get("server_args", {}), job.get("audit", False), job.get("count_calls", False),
                    job.get("stub_attention", False), job.get("host_clock", False))
    startup_s = round(time.time() - started, 1)
    reports = []
    for k, waves in enumerate(job["parts"]):
        if k:
            driver.flush()
        report: dict[str, Any] = {"startup_s": startup_s, "waves": []}
        for wave in waves:
            t = time.time()
            if driver.calls is not None:
                driver.calls.take()
            if driver.clock is not None:
                driver.clock.take()
            driver.submit_wave(wave["requests"])
            driver.wait([r["rid"] for r in wave["requests"]], wave.get("aborts", {}), job.get("timeout", 900),
                        wave.get("aborts_after_forwards"))
            report["waves"].append({"seconds": round(time.time() - t, 1), "pool": driver.pool(),
                                    **({} if driver.calls is None else {"calls": driver.calls.take()}),
                                    **({} if driver.clock is None else {"host_cpu_ms": driver.clock.take()})})
        if driver.error:
            raise RuntimeError(driver.error)
        report["results"] = driver.results()
        report["batches"] = list(driver.batches)
        report["tokens"] = list(driver.tokens)
        report["extends"] = list(driver.extends)
        report["prefills"] = list(driver.prefill_log.lines)
        if job.get("flashinfer_probe"):
            report["flashinfer_probe"] = flashinfer_probe.report()
        report["audit"] = None if driver.audit is None else dict(driver.audit.counts)
        reports.append(report)
    print(json.dumps(reports))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
