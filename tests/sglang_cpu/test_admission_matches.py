"""A context request is matched and planned once when nothing on its tree path changes before it is
committed, however many scheduling steps it waits through while other requests publish KV elsewhere
in the tree (issue #29: each plan of a 30k-token next turn costs milliseconds of host time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import serve
from .scenarios import Conversation

pytestmark = pytest.mark.slow


def test_a_waiting_context_request_is_planned_once(patched_site: Path, tiny_qwen3: Path) -> None:
    """A conversation's first turn is published; its next turn (a drop and a reposition) arrives
    together with a 600-token plain prompt of another conversation, first in the queue, which SGLang
    prefills in 64-token chunks, publishing each chunk. The context request waits for the chunk budget
    through those steps and is matched each step; no publication touches its path (the two
    conversations share no first token), so exactly one plan is needed: one ``core.match`` and one
    ``commit``, where a tree-wide change count planned it again after every chunk."""
    conv = Conversation(11).add(12, 8, 20, 8, 20)
    first = conv.request("first", plain=True, max_new=1)
    conv.messages.append(list(first.ids[-3:]))
    conv.add(8, 20).drop(3).reposition()
    nxt = conv.request("next", max_new=2)
    other = Conversation(12).add(600).request("other", plain=True, max_new=1)
    assert other.ids[0] != nxt.ids[0], "the conversations must not share a path"
    report = serve(patched_site, tiny_qwen3, [{"requests": [first.job()]},
                                              {"requests": [other.job(), nxt.job()]}],
                   chunk=64, count_calls=True)
    results, calls = report["results"], report["waves"][1]["calls"]
    assert results["next"]["finished"] and results["other"]["finished"]
    chunked_steps = sum(batch == ["other"] for batch in report["batches"])
    assert chunked_steps >= 5, f"the context request must have waited through the chunked prefill: {report['batches']}"
    assert (calls["match"], calls["commit"]) == (1, 1), calls
