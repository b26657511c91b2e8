"""The token file of a corpus (the language model's, masked-LM's train split), built once and kept in a cache.

Tokenising a large corpus takes hours (FineWeb's 10B-token sample), so the build is written in
chunks beside a progress record: a killed build continues at the first document it had not
written, and a finished one is reused by every later run with the same corpus, tokenizer and
separator (the tokenizer is trained the same way in every process, so a run that trains its own
finds the file of an earlier run). ``tokenizers`` encodes each batch on all cores.

Cache folder: ``$TK_CACHE/tokens`` (default ``~/.cache/tk/tokens``); files ``KEY.bin`` (done),
``KEY.bin.part`` + ``KEY.progress.json`` (a build in progress).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tk.core.errors import TkError
from tk.core.text import TextTokenizer

__all__ = ["TokenStore", "cache_root"]

log = logging.getLogger(__name__)
_SAVE_EVERY = 64 << 20  # bytes of tokens between progress records (a kill loses at most this much work)


def cache_root() -> Path:
    """``$TK_CACHE`` (default ``~/.cache/tk``)."""
    return Path(os.environ.get("TK_CACHE") or Path.home() / ".cache" / "tk").expanduser()


class TokenStore:
    """The token file of one (corpus, tokenizer, separator) in the cache.

    Args:
        tokenizer: the tokenizer (its whole tokenizer.json is part of the key).
        corpus: what identifies the documents, e.g. ``{"hf_name": ..., "hf_config": ..., "hf_split": ...}``.
        separator: appended to every document.
        dtype: the token dtype.
        root: the cache folder (default ``cache_root() / "tokens"``).
        add_special_tokens: apply the tokenizer's template to each document (False: the bare
            tokens, e.g. masked-LM's stream that ``[CLS]``/``[SEP]`` frame later).
    """

    def __init__(self, tokenizer: TextTokenizer, corpus: dict[str, Any], separator: str, dtype: np.dtype,
                 root: Path | None = None, add_special_tokens: bool = True) -> None:
        self.tokenizer, self.separator, self.dtype = tokenizer, separator, np.dtype(dtype)
        self.add_special_tokens = add_special_tokens
        spec = json.dumps({"tokenizer": tokenizer.to_str(), "corpus": corpus, "separator": separator,
                           "dtype": self.dtype.name} | ({} if add_special_tokens else {"specials": False}),
                          sort_keys=True)
        self.key = hashlib.sha256(spec.encode()).hexdigest()[:24]
        self.root = root if root is not None else cache_root() / "tokens"
        self.path = self.root / f"{self.key}.bin"
        self.part = self.root / f"{self.key}.bin.part"
        self.progress = self.root / f"{self.key}.progress.json"
        self.meta = self.root / f"{self.key}.json"

    def build(self, documents: Iterable[list[str]]) -> tuple[np.ndarray, int, str]:
        """The tokens (memory-mapped) and the character count; tokenises what is not cached yet.

        Args:
            documents: batches of documents, in corpus order (read again from the start when a
                build continues: the written documents are skipped, not tokenised).

        Returns:
            ``(tokens, num_chars, how)`` with ``how`` one of "cached", "continued", "built".

        Raises:
            TkError: the corpus has no token, or the cache folder cannot be written (naming it).
        """
        if self.path.is_file() and self.meta.is_file():
            meta = json.loads(self.meta.read_text(encoding="utf-8"))
            log.info("tokens: tokens of this corpus and tokenizer from the cache %s (%d tokens)",
                     self.path, meta["tokens"])
            return np.memmap(self.path, dtype=self.dtype, mode="r"), int(meta["chars"]), "cached"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TkError(f"the token cache {self.root} cannot be written ({e.strerror}); set TK_CACHE to a "
                          f"writable folder") from e
        done = self._resume_point()
        how = "continued" if done["docs"] else "built"
        if done["docs"]:
            log.info("tokens: continuing the token build in %s after %d documents (%d tokens)",
                     self.part, done["docs"], done["tokens"])
        self._write(documents, done)
        if done["tokens"] == 0:
            raise TkError("data: the corpus has no token (every document is empty); check data.hf_name, "
                          "data.hf_split and data.text_column")
        os.replace(self.part, self.path)
        self.meta.write_text(json.dumps({"tokens": done["tokens"], "chars": done["chars"]}), encoding="utf-8")
        self.progress.unlink(missing_ok=True)
        return np.memmap(self.path, dtype=self.dtype, mode="r"), done["chars"], how

    def _resume_point(self) -> dict[str, int]:
        """Where a previous build stopped (its last progress record), the part file cut there."""
        start = {"docs": 0, "tokens": 0, "chars": 0}
        if self.part.is_file() and self.progress.is_file():
            try:
                start = {k: int(v) for k, v in json.loads(self.progress.read_text(encoding="utf-8")).items()}
            except (ValueError, AttributeError):
                start = {"docs": 0, "tokens": 0, "chars": 0}
        with open(self.part, "r+b" if self.part.is_file() else "wb") as f:
            f.truncate(start["tokens"] * self.dtype.itemsize)  # what was written after the record
        return start

    def _write(self, documents: Iterable[list[str]], done: dict[str, int]) -> None:
        skip, unsaved, started = done["docs"], 0, time.perf_counter()
        bar = tqdm(total=None, unit="tok", unit_scale=True, desc="tokenising", file=sys.stderr,
                   disable=not sys.stderr.isatty(), initial=done["tokens"])
        with open(self.part, "ab") as out, bar:
            for texts in _skip(documents, skip):
                texts = [t + self.separator for t in texts]
                ids = self.tokenizer.encode_batch(texts, add_special_tokens=self.add_special_tokens).ids  # parallel across the batch (tokenizers' threads)
                data = np.concatenate([np.asarray(e, dtype=self.dtype) for e in ids]) if ids else np.zeros(0)
                out.write(data.astype(self.dtype, copy=False).tobytes())
                done["docs"] += len(texts)
                done["tokens"] += len(data)
                done["chars"] += sum(map(len, texts))
                unsaved += data.nbytes
                bar.update(len(data))
                if unsaved >= _SAVE_EVERY:
                    self._record(out, done)
                    unsaved = 0
            self._record(out, done)
        rate = (done["tokens"] / max(time.perf_counter() - started, 1e-9)) / 1e6
        log.info("tokens: tokenised %d documents into %d tokens (%.2f M tokens/s); cached as %s",
                 done["docs"], done["tokens"], rate, self.path)

    def _record(self, out: Any, done: dict[str, int]) -> None:
        """Make the tokens so far durable, then say so (a kill between the two only repeats work)."""
        out.flush()
        os.fsync(out.fileno())
        tmp = self.progress.with_suffix(".tmp")
        tmp.write_text(json.dumps(done), encoding="utf-8")
        os.replace(tmp, self.progress)

    def link_into(self, target: Path) -> None:
        """Put the cached file at ``target`` (a run's task file): a hard link where the file system
        allows (no second copy), else a copy."""
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        try:
            os.link(self.path, target)
        except OSError:
            shutil.copyfile(self.path, target)


def _skip(batches: Iterable[list[str]], n: int) -> Iterator[list[str]]:
    """``batches`` without their first ``n`` documents (a batch cut where needed)."""
    for texts in batches:
        if n >= len(texts):
            n -= len(texts)
            continue
        yield texts[n:]
        n = 0
