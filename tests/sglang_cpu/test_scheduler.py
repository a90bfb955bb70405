"""Drop / Reposition served by SGLang 0.5.16's real Scheduler, TpModelWorker and triton attention
(its Triton kernels interpreted) on the CPU, in FP32: every request's greedy tokens and next-token
logits against the oracle, usage against the cache core's own accounting of the same request
sequence (what the reference server reports), and the pool back to its start after every wave
with SGLang's strict idle leak check on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import append_generated, compile_program
from akv.system.context.rules import parse_rules
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_oracle, run_program
from tests.cache.brute import brute_needed

from . import scenarios
from .conftest import serve, serve_parts
from .scenarios import Request

pytestmark = pytest.mark.slow
LOGIT_TOLERANCE = 1e-5
MODES = {
    "normal-chunk4": {"chunk": 4},
    "normal-chunk64": {"chunk": 64, "env": {"AKV_TP_PLAN_CHECK": "1"}},  # the TP plan check's path at world size 1
    "overlap-chunk4": {"chunk": 4, "overlap": True, "server_args": {"triton_attention_num_kv_splits": 8}},
}
"""The other tests' schedulers decode with one KV split (bench.harness.servers.CPU_KV_SPLITS);
overlap-chunk4 keeps SGLang's default 8, so the split-K path over AKV's KV lists stays checked."""


@pytest.fixture(scope="session")
def oracle_model(tiny_qwen3: Path) -> ReferenceModel:
    return ReferenceModel.from_pretrained(tiny_qwen3, dtype=torch.float32)


AFTER_THE_MATRIX = {"normal-chunk4": (scenarios.abort_waves, scenarios.in_place_abort_waves),
                    "normal-chunk64": (scenarios.segment_join_waves,)}
"""Waves of a test whose own scheduler settings are a mode's but for the checks the mode adds (the
FlashInfer probe, normal-chunk64's TP plan check): served in that mode's process after the matrix, the
cache flushed between."""


@pytest.fixture(scope="module")
def mode_runs(patched_site: Path, tiny_qwen3: Path) -> Callable[[str], list[tuple[list, dict]]]:
    """A mode's runs, served by one process the first time a test asks for them: the matrix's waves and
    report, then those of ``AFTER_THE_MATRIX`` for the mode, in its order."""
    served: dict[str, list[tuple[list, dict]]] = {}

    def runs(mode: str) -> list[tuple[list, dict]]:
        if mode not in served:
            parts = [scenarios.matrix(), *(waves() for waves in AFTER_THE_MATRIX.get(mode, ()))]
            reports = serve_parts(patched_site, tiny_qwen3, [scenarios.job(waves) for waves in parts],
                                  flashinfer_probe=True, **MODES[mode])
            served[mode] = list(zip(parts, reports, strict=True))
        return served[mode]

    return runs


@pytest.fixture(scope="module", params=list(MODES))
def matrix_run(request: pytest.FixtureRequest,
               mode_runs: Callable[[str], list[tuple[list, dict]]]) -> tuple[list, dict]:
    return mode_runs(request.param)[0]


def _program(request: Request):
    if request.program is not None:
        return request.program
    ids = np.array(request.ids, dtype=np.int64)
    return compile_program(ids, np.zeros(ids.size, dtype=np.int64), parse_rules(None, None, 1), 1)


def assert_exact(model: ReferenceModel, request: Request, result: dict[str, Any], *,
                 tolerance: float = LOGIT_TOLERANCE) -> None:
    """Greedy tokens equal the oracle's (teacher-forced on the served ones); logits within FP32 noise."""
    ids = result["ids"]
    assert result["finished"] is not None and result["finished"]["type"] == "length", (request.rid, result["finished"])
    assert len(ids) == request.max_new, request.rid
    if request.program is not None:
        oracle = run_program(model, append_generated(request.program, np.array(ids[:-1], dtype=np.int64)))
    else:
        oracle = run_oracle(model, list(request.ids) + ids[:-1])
    n = len(request.ids)
    expected = oracle.logits[n - 1 :].argmax(-1).tolist()
    assert ids == expected, f"{request.rid}: served {ids}, oracle {expected}"
    for g in range(len(ids)):
        row = torch.tensor(result["logits"][str(g)])
        err = float((row - oracle.logits[n - 1 + g]).abs().max())
        assert err <= tolerance, f"{request.rid}: logits of token {g} off by {err:.2e}"


def expected_usage(waves: list[list[Request]], report: dict, *, cold: bool = False) -> dict[str, dict[str, int]]:
    """Each request's usage from the cache core itself, replaying the served sequence (each wave
    admitted, then finished with its KV'd generated tokens, as the reference server does), planned
    as the patched server plans (resident KV no one else reads rotated in place)."""
    core = CacheCore(SlotPool(1 << 16))
    usage = {}
    for wave in waves:
        admitted = []
        for request in wave:
            active = (CacheCore(SlotPool(1 << 12)) if cold else core).admit(_program(request), in_place=True)
            usage[request.rid] = active.plan.usage.as_dict()
            admitted.append((request, active))
        for request, active in admitted:
            if cold:
                continue
            generated = np.array(report["results"][request.rid]["ids"][:-1], dtype=np.int64)
            core.finish(active, generated, core.allocate(generated.size))
    return usage


def reported_usage(request: Request, result: dict[str, Any]) -> dict[str, int]:
    if request.program is None:  # stock usage: a plain request computed every prompt token it did not read
        assert result["details"] is None or "repos_tokens" not in result["details"]
        return {"cached_tokens": result["cached_tokens"], "repos_tokens": 0, "drop_skipped_tokens": 0,
                "computed_tokens": len(request.ids) - result["cached_tokens"]}
    details = result["details"]
    assert details is not None, f"{request.rid}: a context request must report its usage"
    assert details["cached_tokens"] == result["cached_tokens"] == details["device"]
    return {key: details[key] for key in ("cached_tokens", "repos_tokens", "drop_skipped_tokens", "computed_tokens")}


def assert_pool_back(report: dict) -> None:
    for i, wave in enumerate(report["waves"]):
        pool = wave["pool"]
        assert pool["protected"] == 0, f"wave {i}: {pool}"
        assert pool["available"] + pool["evictable"] == pool["total"], f"wave {i}: {pool}"


def test_matrix_tokens_and_logits_equal_the_oracle(matrix_run: tuple[list, dict], oracle_model: ReferenceModel) -> None:
    waves, report = matrix_run
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, report["results"][request.rid])


def test_matrix_usage_equals_the_cache_cores_accounting(matrix_run: tuple[list, dict]) -> None:
    waves, report = matrix_run
    expected = expected_usage(waves, report)
    for wave in waves:
        for request in wave:
            assert reported_usage(request, report["results"][request.rid]) == expected[request.rid], request.rid
    assert expected["agent-context-2"]["cached_tokens"] > 0, "the first context turn reuses the plain turns"
    assert expected["agent-plain-again"]["cached_tokens"] > 0, "a plain turn after context turns reuses their prefix"


def test_matrix_leaves_the_pool_as_it_found_it(matrix_run: tuple[list, dict]) -> None:
    assert_pool_back(matrix_run[1])


def test_a_reposition_rotates_resident_kv_in_place(matrix_run: tuple[list, dict]) -> None:
    """Issue #28: a turn that repositions resident KV nothing else reads rotates it where it is (the
    pool grows by its new tokens only: the conversation holds one slot per text token, its live
    tokens and the dropped message the tree keeps for its path), and the next turn reads the rotated
    KV as cached; a turn whose old positions a sibling branch still reads copies them (and the
    sibling, sent again, reads them). Exactness of every turn: the matrix's oracle test."""
    waves, report = matrix_run
    wave_of = {r.rid: i for i, wave in enumerate(waves) for r in wave}
    request = {r.rid: r for wave in waves for r in wave}
    held = [p["total"] - p["available"] for p in (w["pool"] for w in report["waves"])]
    assert all(w["pool"]["protected"] == 0 for w in report["waves"])

    def grew(rid: str) -> int:
        return held[wave_of[rid]] - held[wave_of[rid] - 1]

    def text(rid: str) -> int:
        return len(request[rid].ids)

    first, second, third = (f"inplace-{t}" for t in (1, 2, 3))
    new_tokens = text(second) - text(first)  # message 5 and the generation prompt
    assert grew(first) == text(first)
    assert grew(second) == new_tokens, "the 18 repositioned tokens must be rotated in place, not copied"
    assert held[wave_of[second]] - held[wave_of[first] - 1] == text(second)
    usage = reported_usage(request[third], report["results"][third])
    live = text(second) - 9  # message 1 (9 tokens) dropped
    assert usage["repos_tokens"] == 0 and usage["cached_tokens"] == live, usage
    assert grew(third) == text(third) - text(second) + request[third].max_new - 1
    moved = 7 + 8 + 3  # messages 2, 3 and the first turn's generation prompt
    assert grew("sibling-reader") == text("sibling-reader") - text("sibling-1")
    assert grew("sibling-2") == new_tokens + moved, "a sibling reads the old positions: they must be copied"
    again = reported_usage(request["sibling-reader-again"], report["results"]["sibling-reader-again"])
    assert again["repos_tokens"] == 0 and again["cached_tokens"] == text("sibling-reader") - again["computed_tokens"]


def test_flashinfer_plans_read_the_same_visible_kv(matrix_run: tuple[list, dict]) -> None:
    """FlashInfer's decode lists (eager and into a padded CUDA-graph buffer) and paged-prefill lists,
    planned through stand-in wrappers for every context forward, and FA3's page-table rows (eager and
    into padded CUDA-graph buffers), equal the triton backend's."""
    probe = matrix_run[1]["flashinfer_probe"]
    assert probe["decode"] > 0 and probe["extend"] > 0, probe
    assert probe["fa3_decode"] == probe["decode"] and probe["fa3_extend"] == probe["extend"], probe
    assert probe["n_mismatches"] == 0, probe["mismatches"]


def test_context_and_plain_requests_share_batches(matrix_run: tuple[list, dict]) -> None:
    _, report = matrix_run
    mixed = [b for b in report["batches"] if "mixed-plain" in b and any(r.startswith("mixed-ctx") for r in b)]
    assert mixed, "the concurrent wave never put a context and a plain request in one forward"


def assert_prefill_log(waves: list[list[Request]], report: dict) -> None:
    """Each context request's prefill log lines (one per release) count the extend forwards that
    carried it, as the driver saw the model runner called; each timed forward took device time, and
    the copies inside a forward took less than it. Plain requests log nothing."""
    lines: dict[str, list[dict]] = {}
    for line in report["prefills"]:
        lines.setdefault(line["rid"], []).append(line)
    for request in (r for wave in waves for r in wave):
        mine = lines.pop(request.rid, [])
        if request.program is None:
            assert not mine, request.rid
            continue
        assert sum(line["forwards"] for line in mine) == prefill_forwards(report, request.rid), (request.rid, mine)
        for line in mine:
            assert line["forward_ms"] > 0 and line["host_ms"] > 0 and line["wait_ms"] >= 0, line
            assert line["copy_ms"] < line["forward_ms"], line
            assert line["copy_ms"] > 0 or not line["copy_slots"], line
    assert not lines, lines


def test_matrix_prefill_log_counts_each_requests_forwards(matrix_run: tuple[list, dict]) -> None:
    assert_prefill_log(*matrix_run)


def test_forced_retraction_readmits_exactly(patched_site: Path, tiny_qwen3: Path, oracle_model: ReferenceModel) -> None:
    waves = scenarios.retraction_waves()
    report = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=8, env={"SGLANG_TEST_RETRACT": "1"})
    results = report["results"]
    assert results["retract-in-place-2"]["retractions"] > 0, "SGLANG_TEST_RETRACT did not retract the in-place turn"
    expected = expected_usage(waves, report)
    for request in waves[0] + waves[1]:
        assert_exact(oracle_model, request, results[request.rid])
        assert reported_usage(request, results[request.rid]) == expected[request.rid], "usage is the first admission's"
    first_admission = next(line for line in report["prefills"] if line["rid"] == "retract-in-place-2")
    assert first_admission["in_place"] == 18, first_admission
    assert_prefill_log(waves, report)
    assert_pool_back(report)


def test_forced_misses_recover_everything(patched_site: Path, tiny_qwen3: Path, oracle_model: ReferenceModel) -> None:
    waves = scenarios.matrix()[:9]
    report = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=16, env={"SGLANG_RADIX_FORCE_MISS": "1"})
    expected = expected_usage(waves, report, cold=True)
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, report["results"][request.rid])
            if request.program is not None:
                assert reported_usage(request, report["results"][request.rid]) == expected[request.rid]
    assert_pool_back(report)


def test_requests_that_cannot_fit_now_wait_and_are_exact(patched_site: Path, tiny_qwen3: Path,
                                                        oracle_model: ReferenceModel) -> None:
    """A pool too small for the three requests at once: each waits for room (copy slots counted in
    admission, finished KV evicted) instead of failing or stalling, and each is exact."""
    waves = scenarios.pressure_waves()
    report = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=16, max_total_tokens=140)
    for request in waves[0]:
        assert_exact(oracle_model, request, report["results"][request.rid])
    assert_pool_back(report)


@pytest.mark.quick  # the quick tier's one run of the patched scheduler: AKV radix cache, batch metadata, copies
def test_copy_slots_count_in_admission(patched_site: Path, tiny_qwen3: Path, oracle_model: ReferenceModel) -> None:
    """Two turns sent together whose births fit the pool but whose births and re-rotation copies do
    not: the second waits for the first (instead of the scheduler running out of memory) and both
    are exact; FlashInfer's lists planned for the same forwards read the same KV as triton's. Two
    turns that would not fit together with copies but rotate their resident KV in place are not
    made to wait for copies they do not take (issue #28): they share one forward."""
    waves = scenarios.copy_budget_waves()
    report = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=64, max_total_tokens=216,
                   flashinfer_probe=True)
    probe = report["flashinfer_probe"]
    assert probe["extend"] > 0 and probe["n_mismatches"] == 0, probe
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, report["results"][request.rid])
    turns = [r.rid for r in waves[1]]
    assert not any(set(turns) <= set(b) for b in report["batches"]), "both turns ran in one forward"
    in_place = [r.rid for r in waves[3]]
    assert any(set(in_place) <= set(b) for b in report["batches"]), "the in-place turns waited for copies"
    assert_pool_back(report)


ROUNDS_MIXES = ("copies", "two-and-one")
NEAR_POOL = 200
NEAR_COPIES = (3, 5)


@pytest.fixture(scope="module")
def rounds_pressure_runs(patched_site: Path, tiny_qwen3: Path) -> dict[str, tuple[list, dict]]:
    """Each mix's waves and report, one scheduler for all (the same settings), flushed between mixes."""
    waves = [scenarios.rounds_pressure_waves(mix) for mix in ROUNDS_MIXES]
    reports = serve_parts(patched_site, tiny_qwen3, [scenarios.job(w) for w in waves], chunk=128, max_total_tokens=180)
    return dict(zip(ROUNDS_MIXES, zip(waves, reports, strict=True), strict=True))


@pytest.fixture(scope="module")
def near_the_pool_runs(patched_site: Path, tiny_qwen3: Path) -> dict[int | str, tuple[list, dict]]:
    """Each copy count's waves and report, the turns whose copies exceed the pool (``"beyond"``), the
    protect-live scenario's without the flag (up to B's and P's next turns), and a text three times
    the pool (``"longer-than-pool"``), one audited scheduler
    for all, flushed between parts."""
    keys = [*NEAR_COPIES, "beyond", "protect-live-off", "longer-than-pool"]
    waves = ([scenarios.copies_near_the_pool_waves(n) for n in NEAR_COPIES] + [scenarios.copies_beyond_the_pool_waves()]
             + [scenarios.protect_live_waves()[:4], scenarios.longer_than_the_pool_waves()])
    reports = serve_parts(patched_site, tiny_qwen3, [scenarios.job(w) for w in waves], chunk=128,
                          max_total_tokens=NEAR_POOL, audit=True)
    return dict(zip(keys, zip(waves, reports, strict=True), strict=True))


@pytest.fixture(scope="module")
def protect_live_run(patched_site: Path, tiny_qwen3: Path) -> tuple[list, dict]:
    """The protect-live scenario on a scheduler started with ``--akv-protect-live`` (as the launcher
    passes it: ``AKV_PROTECT_LIVE=1``), otherwise as ``near_the_pool_runs``'."""
    waves = scenarios.protect_live_waves()
    return waves, serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=128, max_total_tokens=NEAR_POOL,
                        audit=True, env={"AKV_PROTECT_LIVE": "1"})


def test_a_text_larger_than_the_pool_is_served_on_its_live_kv(near_the_pool_runs: dict,
                                                             oracle_model: ReferenceModel) -> None:
    """Issue #30: a cold request whose text is three times the 200-slot pool but whose rounds hold
    at most 140 slots at once (births no later round reads go back to the pool) is served with the
    oracle's tokens and logits; another, aborted after two forwards (mid-prefill, births already
    given back), leaves the pool as it found it (nothing held, nothing leaked), and sent again it is
    exact too. Both served ones gave births back before they ended (the audit's count)."""
    waves, report = near_the_pool_runs["longer-than-pool"]
    (long,), (aborted,), (again,) = waves
    assert len(long.ids) > 3 * NEAR_POOL
    assert_exact(oracle_model, long, report["results"][long.rid])
    assert report["results"][aborted.rid]["finished"]["type"] == "abort"
    assert_exact(oracle_model, again, report["results"][again.rid])
    assert report["audit"]["recycled_plans"] == 2
    assert_pool_back(report)


@pytest.mark.parametrize("mix", ROUNDS_MIXES)
def test_rounds_left_count_in_admission(rounds_pressure_runs: dict[str, tuple[list, dict]],
                                        oracle_model: ReferenceModel, mix: str) -> None:
    """Five-segment requests sent at once on a pool that holds one of them but not two: a request
    joining between another's rounds must leave it the KV its later rounds and new tokens need (it
    waits instead; without that the scheduler ran out of memory in ``alloc_for_extend``), and every
    request is exact."""
    waves, report = rounds_pressure_runs[mix]
    for request in waves[0]:
        assert_exact(oracle_model, request, report["results"][request.rid])
    assert_pool_back(report)


@pytest.mark.parametrize("n_copies", NEAR_COPIES)
def test_copies_of_a_request_near_the_pool_size_are_served_and_nothing_stalls(
        near_the_pool_runs: dict[int | str, tuple[list, dict]], oracle_model: ReferenceModel, n_copies: int) -> None:
    """Copies of a four-segment turn whose births and copies nearly fill the pool, sent at once with
    another such turn and a plain request while the tree is full of evictable KV: re-rotating its
    births in place, each gets the new tokens the pool leaves beside the tokens an empty cache must
    compute (brute force) and SGLang's 2 admission slots, all it asked for, where counting its copies
    left fewer (issue #28); every request finishes (before, the first copy was never admitted and the
    queue behind it waited forever), is exact, and the pool ends as it began, with every cache read
    checked against the brute force."""
    pool = NEAR_POOL
    waves, report = near_the_pool_runs[n_copies]
    for wave in waves:
        for request in wave:
            granted = request.max_new
            if request.program is not None:
                granted = min(request.max_new, pool - brute_needed(request.program) - 2)
            assert_exact(oracle_model, replace(request, max_new=granted), report["results"][request.rid])
    copy = waves[2][0]
    with_copies = CacheCore(SlotPool(1000)).admit(copy.program).plan.fresh.size  # a one-forward cold admission's slots
    assert with_copies + copy.max_new + 2 > pool, "the case in point: the copies and the new tokens do not fit"
    assert len(report["results"][copy.rid]["ids"]) == copy.max_new
    assert report["audit"]["context_plans"] == len(waves[0]) + n_copies + 1
    assert_pool_back(report)


def test_turns_whose_copies_exceed_the_pool_are_served_exactly(
        near_the_pool_runs: dict[int | str, tuple[list, dict]], oracle_model: ReferenceModel) -> None:
    """A cold turn whose births fit the 200-slot pool but whose births and re-rotation copies (253)
    do not, then its next turn over its published KV: both used to be refused (400 "needs 253 KV
    slots with its re-rotated copies"); now each is served in full, exact against the oracle (every
    cache read checked against the brute force), the cold one re-rotating its 90 repositioned births
    in place (no copy slot), and the pool ends as it began (issue #28)."""
    waves, report = near_the_pool_runs["beyond"]
    cold = waves[0][0]
    assert CacheCore(SlotPool(1000)).admit(cold.program).plan.fresh.size > NEAR_POOL, "the case in point"
    for wave in waves:
        for request in wave:
            assert brute_needed(request.program) + request.max_new + 2 <= NEAR_POOL
            assert_exact(oracle_model, request, report["results"][request.rid])
    (line,) = [line for line in report["prefills"] if line["rid"] == cold.rid]
    assert line["copy_slots"] == 0 and line["in_place"] == 3 * 30, line  # messages 2..4 moved up by one message
    assert report["audit"]["context_plans"] == 2
    assert_pool_back(report)


def _forwards_of(report: dict, rid: str) -> list[int]:
    return [i for i, batch in enumerate(report["batches"]) if rid in batch]


def _kv_held(request: Request, dropped: int = 0) -> int:
    """Slots a finished request leaves in the tree for its conversation: its text and every generated
    token fed back (all but the last), less the tokens of messages it dropped."""
    return len(request.ids) + request.max_new - 1 - dropped


PROTECT_LIVE_DROPPED = 60  # message 1 of live-a, hidden from its generation prompt on


def test_without_protect_live_a_request_beside_a_running_one_evicts_live_kv(
        near_the_pool_runs: dict[int | str, tuple[list, dict]], oracle_model: ReferenceModel) -> None:
    """The default admission: C, admitted in A's pass, counts B's and P's resident live KV as
    evictable, and their next turns find less of it cached than they left (every request exact)."""
    waves, report = near_the_pool_runs["protect-live-off"]
    results = report["results"]
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, results[request.rid])
    assert set(_forwards_of(report, "live-a")) & set(_forwards_of(report, "live-c")), "C ran beside A"
    b1, p1 = waves[0][0], waves[1][0]
    assert results["live-b-2"]["cached_tokens"] < len(b1.ids), results["live-b-2"]
    assert results["live-p-2"]["cached_tokens"] < len(p1.ids), results["live-p-2"]
    assert_pool_back(report)


def test_protect_live_waits_for_dropped_kv_instead_of_evicting_live_kv(
        protect_live_run: tuple[list, dict], oracle_model: ReferenceModel) -> None:
    """With ``--akv-protect-live``: C waits while A runs (its first forward after A's last), takes the
    slots of A's dropped message once A finishes, and B's and P's next turns read all the live KV
    they left as cached (usage as the cache core's own accounting on an unbounded pool). The pool
    after each wave holds exactly every conversation's live KV (A's dropped message gone). D, at the
    head of the queue with nothing running, needs more than the KV that is not live: it is still
    admitted (evicting live KV, as without the flag); E, sent with it, waits for it. Every request is
    exact, every cache read checked against the brute force, the pool back to its start."""
    waves, report = protect_live_run
    results = report["results"]
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, results[request.rid])
    assert max(_forwards_of(report, "live-a")) < min(_forwards_of(report, "live-c")), report["batches"]
    (b1,), (p1,), (a, c), (b2, p2), (d, e) = waves
    assert results["live-b-2"]["cached_tokens"] == len(b1.ids), results["live-b-2"]
    assert results["live-p-2"]["cached_tokens"] == len(p1.ids), results["live-p-2"]
    expected = expected_usage(waves, report)
    for request in (r for wave in waves for r in wave):
        assert reported_usage(request, results[request.rid]) == expected[request.rid], request.rid
    held = [w["pool"]["total"] - w["pool"]["available"] for w in report["waves"]]
    live = _kv_held(b1) + _kv_held(p1) + _kv_held(a, PROTECT_LIVE_DROPPED) + _kv_held(c)
    assert held[2] == live, (held, live)
    live += _kv_held(b2) - _kv_held(b1) + _kv_held(p2) - _kv_held(p1)
    assert held[3] == live, (held, live)
    assert len(d.ids) > NEAR_POOL - live, "D must need live KV's slots"
    assert max(_forwards_of(report, "live-d")) < min(_forwards_of(report, "live-e")), report["batches"]
    assert report["audit"]["context_plans"] == 4 and report["audit"]["evicted"] > 0, report["audit"]
    assert_pool_back(report)


def test_plain_requests_join_the_rounds_of_a_multi_segment_request(
        mode_runs: Callable[[str], list[tuple[list, dict]]], oracle_model: ReferenceModel) -> None:
    """SGLang's one chunked-request slot is taken by a turn with two segments; short plain requests
    sent with it run in its first round's forward instead of waiting for its last, and all are exact."""
    waves, report = mode_runs("normal-chunk64")[1]
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, report["results"][request.rid])
    first = next(b for b in report["batches"] if "join-turn" in b)
    assert {"join-plain-0", "join-plain-1"} <= set(first), first
    assert_pool_back(report)


def prefill_forwards(report: dict, rid: str) -> int:
    """Extend forwards that carried ``rid`` (as the driver saw the model runner called)."""
    return sum(rid in batch and extend for batch, extend in zip(report["batches"], report["extends"]))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_multi_segment_requests_prefill_in_one_forward(
        patched_site: Path, tiny_qwen3: Path, oracle_model: ReferenceModel, overlap: bool) -> None:
    """Five context requests with two or five segments each, sent together, all within one chunk of
    256: one forward carries all five, each prefills in that one forward (its segments side by side,
    each attending to its own visible KV), each equals the oracle, and the one aborted after that
    forward releases everything."""
    waves = scenarios.parallel_rounds_waves()
    report = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=256, overlap=overlap)
    rids = [r.rid for r in waves[1]]
    assert any(set(rids) <= set(b) for b in report["batches"]), report["batches"]
    core = CacheCore(SlotPool(1 << 16))  # the tree the second wave meets: the warm turns' first turns
    for request in waves[0]:
        generated = np.array(report["results"][request.rid]["ids"][:-1], dtype=np.int64)
        core.finish(core.admit(_program(request)), generated, core.allocate(generated.size))
    for request in waves[1]:
        assert len(core.match(request.program).plan.plan.segments) >= 2, request.rid
        assert prefill_forwards(report, request.rid) == 1, (request.rid, report["batches"])
    assert_prefill_log(waves, report)
    for line in report["prefills"]:
        if line["rid"] in rids:
            assert line["rounds_ms"] == 0, line  # one forward: no scheduling step between rounds
    assert report["results"]["rounds-cold-aborted"]["finished"]["type"] == "abort"
    for request in waves[0] + waves[1][:-1]:
        assert_exact(oracle_model, request, report["results"][request.rid])
    assert_pool_back(report)


def test_aborts_release_everything_and_the_next_requests_are_exact(
        mode_runs: Callable[[str], list[tuple[list, dict]]], oracle_model: ReferenceModel) -> None:
    waves, report = mode_runs("normal-chunk4")[1]
    for request in (waves[0][0], waves[1][0]):
        assert report["results"][request.rid]["finished"]["type"] == "abort", request.rid
    for request in waves[2]:
        assert_exact(oracle_model, request, report["results"][request.rid])
    assert_pool_back(report)


def test_an_in_place_turn_aborted_mid_prefill_loses_only_what_it_rotated(
        mode_runs: Callable[[str], list[tuple[list, dict]]], oracle_model: ReferenceModel) -> None:
    """A turn that rotates 18 resident tokens in place is aborted after its first round (its rotation
    ran): every slot it allocated is freed, and of the tree only the 18 versions it overwrote are
    gone (the pool holds the first turn's text less those 18); the turn sent again recomputes them
    (usage says so, as the cache core's own accounting with the abort does), and every later request,
    context or plain, is exact."""
    waves, report = mode_runs("normal-chunk4")[2]
    results = report["results"]
    assert results["iabort-2"]["finished"]["type"] == "abort", results["iabort-2"]["finished"]
    for wave in waves[2:] + waves[:1]:
        for request in wave:
            assert_exact(oracle_model, request, results[request.rid])
    assert_pool_back(report)
    held = [w["pool"]["total"] - w["pool"]["available"] for w in report["waves"]]
    first = waves[0][0]
    assert held[0] == len(first.ids) and held[1] == held[0] - 18, held
    core = CacheCore(SlotPool(1 << 12))
    expected = {}
    for wave in waves:
        (request,) = wave
        active = core.admit(_program(request), in_place=True)
        expected[request.rid] = active.plan.usage.as_dict()
        if request.rid == "iabort-2":
            core.abort(active)
            continue
        generated = np.array(results[request.rid]["ids"][:-1], dtype=np.int64)
        core.finish(active, generated, core.allocate(generated.size))
    for wave in waves[2:]:
        (request,) = wave
        assert reported_usage(request, results[request.rid]) == expected[request.rid], request.rid
    again = expected["iabort-2-again"]
    assert again["repos_tokens"] == 0 and again["computed_tokens"] == 18 + 40 + 3, again


def test_a_plain_reader_in_the_batch_of_an_in_place_turn(
        patched_site: Path, tiny_qwen3: Path, oracle_model: ReferenceModel) -> None:
    """A plain request of a first turn's text admitted in the same pass as the next turn, which rotates
    18 of those tokens in place: admitted after the turn's lock, it stops its match before the
    versions the turn set aside (it computes them) and the turn still rotates them in place (a match
    that read them would make the turn's commit copy them, uncharged); admitted first, it holds them
    and the turn copies them. Each order shares one batch; all are exact, usage is the cache core's
    and the pool comes back."""
    waves = scenarios.plain_reader_race_waves()
    report = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=64, max_total_tokens=256)
    results = report["results"]
    expected = expected_usage(waves, report)
    for wave in waves:
        for request in wave:
            assert_exact(oracle_model, request, results[request.rid])
            assert reported_usage(request, results[request.rid]) == expected[request.rid], request.rid
    assert_pool_back(report)
    assert any({"turn-first-2", "turn-first-plain"} <= set(b) for b in report["batches"]), report["batches"]
    assert results["turn-first-plain"]["cached_tokens"] == 6 + 9, "read up to the versions set aside"
    (line,) = [line for line in report["prefills"] if line["rid"] == "turn-first-2"]
    assert line["in_place"] == 18 and line["copy_slots"] == 0, line
    assert any({"plain-first-2", "plain-first-plain"} <= set(b) for b in report["batches"]), report["batches"]
    assert results["plain-first-plain"]["cached_tokens"] == 32
    (line,) = [line for line in report["prefills"] if line["rid"] == "plain-first-2"]
    # the plain request locks the first 32 tokens (SGLang computes a prompt's last token again): the
    # turn copies the 17 of them it moves and rotates the 33rd, which no one holds, in place
    assert line["copy_slots"] == 17 and line["in_place"] == 1, line


def test_plain_traffic_through_the_akv_backend_is_stock(patched_site: Path, tiny_qwen3: Path,
                                                        oracle_model: ReferenceModel) -> None:
    """The same plain requests through stock RadixCache and through the AKV backend: same tokens,
    same cached_tokens (and both exact)."""
    waves = scenarios.plain_waves()
    stock = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=8, backend=None)
    akv = serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=8, backend="akv")
    for wave in waves:
        for request in wave:
            got, want = akv["results"][request.rid], stock["results"][request.rid]
            assert got["ids"] == want["ids"], request.rid
            assert got["cached_tokens"] == want["cached_tokens"], request.rid
            assert_exact(oracle_model, request, got)
    assert stock["results"]["plain-1-again"]["cached_tokens"] > 0
    assert_pool_back(akv)
