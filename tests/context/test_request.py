"""compile_request: fields validated first, then the prompt SGLang would encode, laid out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from akv.system.context.request import compile_request
from akv.system.context.rules import FutureDropError

MESSAGES = [
    {"role": "user", "content": "Find the file."},
    {"role": "assistant", "content": "Looking."},
    {"role": "user", "content": "Here is a long listing: a b c d e f g"},
    {"role": "assistant", "content": "Found it."},
    {"role": "user", "content": "Thanks, continue."},
]


def test_smollm2_request_drops_and_repositions(smollm2: Any) -> None:
    result = compile_request(smollm2, MESSAGES, drop_message={"3": [2]}, reposition=[3])
    prov, program = result.provenance, result.program
    assert prov.text == smollm2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert program.token_ids.tolist() == smollm2.encode(prov.text, add_special_tokens=False)
    dropped = np.flatnonzero(prov.owners == 2)
    assert program.keep.tolist() == [o != 2 for o in prov.owners.tolist()]
    first_after = int(np.flatnonzero(prov.owners == 4)[0])
    assert program.visible_until[dropped].tolist() == [first_after] * dropped.size
    assert program.next_position == len(prov.token_ids) - dropped.size
    assert result.rules.repositions == (3,)


def test_bad_fields_fail_before_rendering() -> None:
    with pytest.raises(FutureDropError, match=r"drop_message\['1'\]\[0\]: message 3 is after its anchor 1"):
        compile_request(object(), MESSAGES, drop_message={"1": [3]})
