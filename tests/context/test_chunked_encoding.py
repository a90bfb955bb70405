"""Long prompts are encoded in pieces that start at special tokens: the same ids and offsets as one
encode of the whole text (forced here on a short text), and no pieces for a tokenizer whose
pre-tokeniser marks the start of a text (a Metaspace prefix)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from akv.system.context import provenance
from akv.system.context.provenance import ChatTemplate, token_provenance
from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server.model_dir import load_model_dir

MESSAGES = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}] + [
    {"role": "assistant" if i % 2 else "user", "content": f"part {i}: " + " ".join(f"w{k}" for k in range(i * 7))}
    for i in range(1, 12)]


def test_pieces_give_the_ids_and_offsets_of_one_encode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = load_model_dir(make_tiny_model(tmp_path / "model", seed=3))
    owned = ChatTemplate(files.chat_template).render_owned(MESSAGES, add_generation_prompt=True)
    backend = getattr(files.tokenizer, "backend_tokenizer", files.tokenizer)
    whole = backend.encode(owned.text, add_special_tokens=False)
    monkeypatch.setattr(provenance, "PIECE_CHARS", 100)
    assert len(provenance._piece_starts(backend, owned.text)) >= 5
    prov = token_provenance(owned, files.tokenizer)
    assert prov.token_ids.tolist() == whole.ids
    assert np.array_equal(prov.offsets, np.asarray(whole.offsets))


def test_a_prefix_space_tokenizer_is_encoded_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = Tokenizer(models.WordLevel({"<s>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.add_special_tokens(["<s>"])
    monkeypatch.setattr(provenance, "PIECE_CHARS", 4)
    assert provenance._piece_starts(tokenizer, "a b <s> c d <s> e f <s> g") == []
