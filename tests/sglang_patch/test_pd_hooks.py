"""The PD hooks in the patched SGLang, through SGLang's own classes on the CPU (``pd_probe.py``, its
own process): for conversations with drops, repositions and repeated turns, what the prefill
server's ``finalize_bootstrap`` and ``send_kv_chunk`` send, and what the decode server's
pre-allocation, receiving indices, transfer commit and decode positions do with it, against the
brute-force KV model; the decode server's refusals of a row that is not its program's; and the
decode-side attach (in this process)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

from akv.system.adapter import pd_decode, usage
from akv.system.adapter.disaggregation import CONTEXT_MARKER, METADATA_COLUMNS, DecodeLayout
from akv.system.adapter.scheduling import attach
from akv.system.context.rules import RuleError, parse_rules
from akv.system.context.wire import encode_program
from tests.cache.conversations import Conversation

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIRST_TOKEN = 11  # pd_probe.FIRST_TOKEN

HAND = [
    {"messages": [[1, 2], [3, 4], [5, 6], [7, 8], [9]], "drops": {"2": [1]}, "repositions": []},
    {"messages": [[1, 2], [3, 4], [5, 6], [7, 8], [9]], "drops": {"2": [1]}, "repositions": [2]},
    {"messages": [[1, 2], [3], [1, 2], [3, 4, 5], [2], [1]], "drops": {"3": [0, 2], "5": [4]}, "repositions": [3, 5]},
]


def _random_conversations(seed: int, count: int) -> list[dict]:
    """Conversations over a 3-token vocabulary (shared prefixes), ops drawn where the rules allow them."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        n = rng.randint(3, 7)
        messages = [[rng.randrange(3) for _ in range(rng.randint(1, 4))] for _ in range(n)]
        drops, dropped, repositions = {}, set(), []
        for anchor in range(1, n):
            if rng.random() < 0.4:
                names = [m for m in range(anchor + 1) if m not in dropped and rng.random() < 0.4]
                if names:
                    drops[str(anchor)] = names
                    dropped.update(names)
            if rng.random() < 0.3:
                repositions.append(anchor)
        try:
            parse_rules(drops or None, repositions or None, n)
        except RuleError:
            continue
        out.append({"messages": messages, "drops": drops, "repositions": repositions})
    return out


@pytest.fixture(scope="module")
def report(patched_site: Path) -> dict:
    job = {"conversations": HAND + _random_conversations(7, 6)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_site), str(ROOT)]), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(HERE / "pd_probe.py")], input=json.dumps(job), capture_output=True,
                          text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_prefill_server_sends_the_kept_columns_once_in_column_order(report: dict) -> None:
    """``finalize_bootstrap`` announces V pages (not the prompt's length); ``send_kv_chunk`` sends nothing
    before the last round, then once: the slots whose KV is each kept token at its final position, in
    the single server's column order (the brute force's terminal view)."""
    assert any(t["visible"] < t["n_tokens"] for t in report["turns"]), "no turn dropped anything"
    for i, turn in enumerate(report["turns"]):
        assert turn["init_pages"] == turn["visible"], i
        assert turn["middle_sends"] == 0 and turn["sends"] == 1, i
        assert turn["sent_columns"] == turn["expected_columns"], i


def test_the_terminal_copies_run_before_the_send(report: dict) -> None:
    """The plan's terminal re-rotations run once, on the KV pool, before the slots go out (the sent
    labels above already carry their final positions); a turn without them runs none."""
    with_copies = [t for t in report["turns"] if t["terminal_copies"]["dst"]]
    assert with_copies, "no turn re-rotated at its end"
    for turn in report["turns"]:
        if turn["terminal_copies"]["dst"]:
            assert turn["copies_run"] == [turn["terminal_copies"]]
        else:
            assert turn["copies_run"] == []


def test_the_metadata_row_carries_the_layout_and_usage_and_keeps_sglangs_columns(report: dict) -> None:
    for turn in report["turns"]:
        row, used = turn["prefill_row"], turn["prefill_usage"]
        assert row[0] == used["cached_tokens"], "SGLang's own cached_tokens column"
        assert row[METADATA_COLUMNS.start:METADATA_COLUMNS.stop] == [
            CONTEXT_MARKER, turn["visible"], row[9], used["cached_tokens"], used["repos_tokens"],
            used["drop_skipped_tokens"], used["computed_tokens"]]
        assert row[14:] == [99, 99], "spare columns after AKV's are left alone"


def test_a_plain_request_sends_its_prompt_and_clears_the_context_columns(report: dict) -> None:
    plain = report["plain"]
    assert plain["pages"] == list(range(120, 126)), "stock: req_to_token[start:end] of its row"
    assert plain["row"][METADATA_COLUMNS.start:METADATA_COLUMNS.stop] == [0] * 7


def test_a_context_requests_text_is_not_held_against_the_pool_on_the_prefill_server(report: dict) -> None:
    """SGLang refuses a prompt longer than the pool; a context request's need was checked on arrival."""
    assert report["capacity"] == {"plain": True, "context": False}


def test_the_decode_server_allocates_and_receives_v_columns(report: dict) -> None:
    """SGLang's pre-allocation takes exactly V slots (its prompt is the kept tokens), the receiving
    indices it sends the prefill server are those V slots, and after the transfer its row holds the kept
    keys in column order; the prefill's first token is committed and nothing is aborted."""
    for i, turn in enumerate(report["turns"]):
        v = turn["visible"]
        assert turn["decode_input_ids"] == turn["kept_ids"], i
        assert turn["decode_allocated"] == turn["decode_slots_taken"] == len(turn["receiving"]) == v, i
        assert turn["extend_range"] == [0, v], i
        assert turn["row_columns"] == turn["expected_columns"], i
        assert turn["decode_output_ids"] == [FIRST_TOKEN] and turn["decode_finished"] == "None", i


def test_the_decode_server_reports_the_prefill_usage_and_the_texts_length(report: dict) -> None:
    for i, turn in enumerate(report["turns"]):
        used = turn["prefill_usage"]
        assert turn["decode_details"] == {"device": used["cached_tokens"], "host": 0, **used}, i
        assert turn["decode_cached_tokens"] == used["cached_tokens"], i
        assert turn["decode_prompt_tokens"] == turn["n_tokens"], i


def test_decode_steps_are_at_the_positions_of_the_definitional_model(report: dict) -> None:
    """SGLang's ``seq_len - 1`` plus the hook's offset: the brute force's birth position of every
    generated token (after a Drop without a Repos, not the column)."""
    assert any(t["expected_positions"][0] != t["visible"] for t in report["turns"]), "no gapped next position"
    for i, turn in enumerate(report["turns"]):
        assert turn["positions"] == turn["expected_positions"], i


def test_the_prefill_side_leaks_nothing(report: dict) -> None:
    ends = [t["prefill_pool_free"] for t in report["turns"] if "prefill_pool_free" in t]
    assert ends == [True] * (len(HAND) + 6)


def test_a_row_from_another_program_or_a_plain_prefill_is_refused(report: dict) -> None:
    other, plain = report["refusals"]["other_program"], report["refusals"]["plain_row"]
    assert other["aborted"] and other["status"] == 400 and "the prefill server sent V=" in other["message"]
    assert other["message"].startswith("server configuration: ")
    assert plain["aborted"] and plain["status"] == 400 and "did not send context-request metadata" in plain["message"]
    assert other["details"] is None and plain["details"] is None, "no usage reported for a refused transfer"
    window = report["refusals"]["sliding_window"]
    assert window["aborted"] and window["status"] == 400 and "without sliding-window" in window["message"]


# ------------------------------------------------------------------ decode-side attach ---

DECODE = SimpleNamespace(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=False,
                         radix_cache_backend=None, chunked_prefill_size=16)


def _decode_request(conv: Conversation, turn: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    program = conv.program(turn)
    req = SimpleNamespace(origin_input_ids=array("q", program.token_ids.tolist()), akv=None, akv_pd=None,
                          sampling_params=SimpleNamespace(max_new_tokens=4))
    return req, SimpleNamespace(context_program=encode_program(program))


def test_decode_attach_makes_the_kept_tokens_the_prompt() -> None:
    conv = Conversation(((1, 2), (3, 4), (5, 6), (7, 8)), {2: (1,)}, ())
    req, recv = _decode_request(conv, 3)
    assert attach(req, recv, DECODE, pool_size=100, context_len=64) is None
    assert req.akv is None, "no AKV cache state on a decode server"
    assert list(req.origin_input_ids) == [1, 2, 5, 6, 7, 8]
    assert req.akv_pd.layout == DecodeLayout(visible=6, next_position=8)
    assert usage.prompt_tokens(req) == 8 and usage.is_context(req)
    assert usage.cached_tokens_details(req) is None, "no usage before the KV arrived"


def test_decode_attach_refuses_a_decode_side_radix_cache_and_a_bad_program() -> None:
    conv = Conversation(((1, 2), (3, 4), (5, 6)), {2: (1,)}, ())
    req, recv = _decode_request(conv, 2)
    radix = SimpleNamespace(**{**vars(DECODE), "disaggregation_decode_enable_radix_cache": True})
    assert "disaggregation_decode_enable_radix_cache" in attach(req, recv, radix, 100, 64)
    req.origin_input_ids = req.origin_input_ids[::-1]
    assert "its tokens differ" in attach(req, recv, DECODE, 100, 64)
    req, recv = _decode_request(conv, 2)
    assert "context length" in attach(req, recv, DECODE, 100, 5)
    assert req.akv_pd is None and list(req.origin_input_ids) == [1, 2, 3, 4, 5, 6], "a refused request is untouched"


def test_decode_positions_leave_plain_requests_alone() -> None:
    import torch

    plain = SimpleNamespace(akv_pd=None)
    pd = SimpleNamespace(akv_pd=pd_decode.PdDecodeRequest(DecodeLayout(visible=6, next_position=8), 8))
    columns = torch.tensor([6, 9, 6], dtype=torch.int32)
    got = pd_decode.decode_positions(SimpleNamespace(reqs=[plain, pd, plain]), columns)
    assert got.tolist() == [6, 11, 6] and got.dtype == torch.int32
    alone = columns[:1]
    assert pd_decode.decode_positions(SimpleNamespace(reqs=[plain]), alone) is alone, "an all-plain step: unchanged"
