"""The language model's token cache (issue #36 item 3): a built token file is reused by later
runs, a killed build continues where it stopped and gives the same tokens as an uninterrupted one."""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.text import TextTokenizer, TokenizerConfig, token_store
from tk.core.text.token_store import TokenStore
from tk.plugins.language_model.corpus import synthetic_text

DOCS = [d for d in synthetic_text(600, 3).split("\n") if d]


def batches(docs, size=50, stop_after=None):
    for n, i in enumerate(range(0, len(docs), size)):
        if stop_after is not None and n == stop_after:
            raise KeyboardInterrupt  # a kill: nothing after this batch runs
        yield docs[i:i + size]


@pytest.fixture
def tok():
    return TextTokenizer.train(DOCS, TokenizerConfig(kind="bpe", vocab_size=300))


def expected(tok) -> np.ndarray:
    return np.asarray([i for d in DOCS for i in tok.encode(d + "\n\n")], dtype=np.uint16)


def test_build_then_reuse(tmp_path, tok):
    store = TokenStore(tok, {"hf_name": "x"}, "\n\n", np.uint16, root=tmp_path)
    tokens, chars, how = store.build(batches(DOCS))
    assert how == "built" and np.array_equal(tokens, expected(tok)) and chars == sum(len(d) + 2 for d in DOCS)
    again = TokenStore(tok, {"hf_name": "x"}, "\n\n", np.uint16, root=tmp_path)
    tokens2, chars2, how2 = again.build(iter(()))  # nothing read: the cached file
    assert how2 == "cached" and np.array_equal(tokens2, tokens) and chars2 == chars
    other = TokenStore(tok, {"hf_name": "y"}, "\n\n", np.uint16, root=tmp_path)
    assert other.key != store.key  # another corpus, another file


@pytest.mark.parametrize("garbage", [0, 37])
def test_a_killed_build_continues_and_equals_an_uninterrupted_one(tmp_path, tok, monkeypatch, garbage):
    monkeypatch.setattr(token_store, "_SAVE_EVERY", 1)  # a progress record after every batch
    store = TokenStore(tok, {"hf_name": "x"}, "\n\n", np.uint16, root=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        store.build(batches(DOCS, stop_after=4))
    assert store.part.is_file() and not store.path.exists()
    with open(store.part, "ab") as f:  # bytes written after the last record (a kill mid-write)
        f.write(b"\x01" * garbage)
    tokens, _, how = TokenStore(tok, {"hf_name": "x"}, "\n\n", np.uint16, root=tmp_path).build(batches(DOCS, size=70))  # other batches: documents count
    assert how == "continued" and np.array_equal(tokens, expected(tok))
    assert not store.progress.exists() and not store.part.exists()


@pytest.mark.slow
def test_two_runs_share_one_token_file(tmp_path):
    import datasets

    folder = tmp_path / "corpus"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder))
    args = ["lm_synthetic", "data.source=hf", f"data.hf_name={folder}", "model.dim=16", "model.depth=1",
            "model.num_heads=2", "train.max_steps=1", "train.progress=false", "data.eval_blocks=2"]
    for name in ("a", "b"):
        result = CliRunner().invoke(cli, ["run", *args, f"output_dir={tmp_path / name}"])
        assert result.exit_code == 0, result.output
    a, b = (tmp_path / n / "artifacts" / "tokens.bin" for n in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    assert os.stat(a).st_ino == os.stat(b).st_ino  # one file: hard links to the cache
    assert "from the cache" in (tmp_path / "b" / "train.log").read_text()
