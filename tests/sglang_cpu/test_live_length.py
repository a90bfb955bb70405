"""A conversation whose text is 4x the model's context length, served by SGLang's real scheduler on
the CPU because its drops and repositions keep the live length under the limit: tokens and logits
equal the oracle's, and the pool is back to its start after every wave. The same conversation
without drops is refused naming ``messages`` and its live length (the text length, by hand: no drop
means nothing leaves it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from akv.system.models.tiny import make_tiny_model
from akv.system.reference.model import ReferenceModel

from . import scenarios
from .conftest import serve
from .scenarios import Conversation, Request
from .test_scheduler import assert_exact, assert_pool_back

pytestmark = pytest.mark.slow
CONTEXT = 64
TURNS = 9
MAX_NEW = 3


def long_conversation(*, drops: bool) -> list[Request]:
    """A task (two protected messages), then per turn an assistant call (4 tokens) and a tool result
    (24); with ``drops`` each call drops the previous turn and repositions, so at most one turn is
    live. Requests at turns 3, 6 and 9 (the last one's text is over 4x ``CONTEXT``)."""
    conv = Conversation(11).add(6, 5)
    requests = []
    for turn in range(1, TURNS + 1):
        conv.add(4)
        if drops and turn > 1:
            conv.drop(len(conv.messages) - 3, len(conv.messages) - 2)
        conv.reposition()  # without drops too: a context request either way
        conv.add(24)
        if turn % 3 == 0:
            requests.append(conv.request(f"{'drops' if drops else 'no-drops'}-{turn}", max_new=MAX_NEW))
    return requests


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("live-length") / "model", seed=3, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def run(patched_site: Path, short_model: Path) -> tuple[list[Request], list[Request], dict]:
    kept, refused = long_conversation(drops=True), long_conversation(drops=False)[-1:]
    waves = [[r] for r in kept] + [refused]
    report = serve(patched_site, short_model, scenarios.job(waves), chunk=16,
                   env={"AKV_MAX_TEXT_TOKENS": str(8 * CONTEXT)})
    return kept, refused, report


def test_the_text_is_4x_the_context_and_the_live_length_fits() -> None:
    last = long_conversation(drops=True)[-1]
    assert len(last.ids) >= 4 * CONTEXT
    assert last.program is not None and last.program.next_position + MAX_NEW <= CONTEXT


def test_served_tokens_and_logits_equal_the_oracle(run: tuple, short_model: Path) -> None:
    kept, _, report = run
    model = ReferenceModel.from_pretrained(short_model, dtype=torch.float32)
    for request in kept:
        assert_exact(model, request, report["results"][request.rid])


def test_without_drops_the_400_names_messages_and_the_live_length(run: tuple) -> None:
    _, (refused,), report = run
    finished = report["results"][refused.rid]["finished"]
    assert finished["type"] == "abort" and finished["status_code"] == 400, finished
    message = finished["message"]
    assert message.startswith("messages: ")
    assert f"the live length is {len(refused.ids)} tokens" in message
    assert f"maximum context length of {CONTEXT} tokens" in message
    assert f"at least {len(refused.ids) + 1 - CONTEXT} more tokens" in message


def test_no_slot_is_leaked(run: tuple) -> None:
    assert_pool_back(run[2])
