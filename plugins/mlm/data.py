"""The ``data:`` and ``tokenizer:`` sections, reading the corpus (text files, a ``datasets``
corpus or the synthetic sentences), cutting it into ``[CLS] ... [SEP]`` sequences, and BERT's
token masking."""

from __future__ import annotations

import glob
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.core.text import TextTokenizer, TokenizerConfig, iter_column, load_hub_dataset
from tk.plugins.text_classification.synthetic import synthetic_rows

IGNORE = -100  # label of a position that is not predicted (cross_entropy_sum's ignore_index)
MASK = "[MASK]"
REPLACE_MASK, REPLACE_RANDOM = 0.8, 0.1  # of the chosen tokens: 80% -> [MASK], 10% -> random, 10% kept (BERT)


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "text", "hf"] = "synthetic"  # synthetic sentences; text: data.path; hf: data.hf_name
    path: str | None = None  # source=text: a UTF-8 file, a folder of files or a glob (sorted order)
    split_on: Literal["line", "blank_line"] = "line"  # source=text: one text per line, or per paragraph (blank line)
    hf_name: str | None = None  # source=hf: a datasets hub name, or a folder written by save_to_disk
    hf_config: str | None = None  # source=hf: the dataset's configuration name
    hf_split: str = "train"  # source=hf: the one split read (val = its last val_fraction of texts)
    text_column: str = "text"  # source=hf: the column holding the texts
    num_sentences: int = 20000  # synthetic: sentences (text_classification's synthetic corpus, labels dropped)
    seed: int = 0  # synthetic: seed of the corpus; also seeds the fixed masks of the val split
    max_len: int = 64  # tokens per sequence incl. [CLS] and [SEP]
    pack: bool = True  # true: texts joined and cut into full max_len sequences; false: one text per sequence
    val_fraction: float = 0.05  # the last fraction of the texts is the validation split
    streaming: bool = False  # source text/hf, with pack and token_cache: never hold the corpus in memory (a pass counts the texts, one builds the token file, a streamed hub split)
    token_cache: bool = True  # pack with source text/hf: the train split's tokens in $TK_CACHE/tokens (built in chunks, continued after a kill, reused by later runs)
    mask_prob: float = 0.15  # fraction of the non-special tokens chosen for prediction (80/10/10 as in BERT)


@dataclass
class MLMTokenizerConfig(TokenizerConfig):
    """The ``tokenizer:`` section: trained on the train texts with BERT's specials plus
    ``[MASK]`` (the same tokenizer.json layout as text_classification's), unless ``path`` is set."""

    kind: Literal["wordpiece", "bpe", "unigram", "char"] = "wordpiece"  # wordpiece (BERT), byte-level bpe, unigram, char
    vocab_size: int = 8000  # tokens incl. [PAD] [UNK] [CLS] [SEP] [MASK]
    lowercase: bool = True  # lowercase first (wordpiece also strips accents)
    min_frequency: int = 0  # bpe/wordpiece: occurrences a merge or piece needs (0: the trainers' default)


def check_data(d: DataConfig) -> list[str]:
    """Problems of the ``data:`` section, one line each naming the key."""
    problems = []
    if d.source == "text" and not d.path:
        problems.append("data.path: source=text needs a text file, folder or glob (or set data.source=synthetic)")
    if d.source == "hf" and not d.hf_name:
        problems.append("data.hf_name: source=hf needs a datasets name (or a save_to_disk folder)")
    if d.max_len < 4:
        problems.append(f"data.max_len ({d.max_len}) must be >= 4")
    if not 0.0 < d.val_fraction < 1.0:
        problems.append(f"data.val_fraction ({d.val_fraction}) must be in (0, 1)")
    if not 0.0 < d.mask_prob < 1.0:
        problems.append(f"data.mask_prob ({d.mask_prob}) must be in (0, 1)")
    if d.streaming and (d.source == "synthetic" or not d.pack or not d.token_cache):
        problems.append("data.streaming needs data.source text or hf with data.pack=true and data.token_cache=true "
                        "(the train tokens then live in the cache file, not in memory)")
    if d.num_sentences < 2:
        problems.append(f"data.num_sentences ({d.num_sentences}) must be >= 2")
    return problems


# -- reading --------------------------------------------------------------------------------
def _files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    return sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())


def _read_files(d: DataConfig) -> list[str]:
    files = _files(d.path)
    if not files:
        raise TkError(f"data.path: no text file at {d.path!r} (give a file, a folder of text files or a glob, "
                      f"or set data.source=synthetic)")
    return [t for f in files for t in _file_texts(f, d.split_on)]


def _file_texts(f: Path, split_on: str) -> Iterator[str]:
    """The texts of one file, read line by line (``blank_line``: paragraphs, ended by a blank
    line), whitespace runs made single spaces; empty ones are dropped by the callers."""
    try:
        with open(f, encoding="utf-8") as lines:
            paragraph: list[str] = []
            for line in lines:
                if split_on == "line":
                    yield " ".join(line.split())
                elif line.strip():
                    paragraph.append(line)
                else:
                    yield " ".join(" ".join(paragraph).split())
                    paragraph = []
            if paragraph:
                yield " ".join(" ".join(paragraph).split())
    except UnicodeDecodeError as e:
        raise TkError(f"data.path: {f} is not UTF-8 text ({e}); convert it or leave it out of data.path") from e


def iter_texts(d: DataConfig) -> Iterator[str]:
    """The non-empty texts of ``d.source`` in order, read as they come (a hub split streamed)."""
    if d.source == "hf":
        ds = load_hub_dataset(d.hf_name, d.hf_config, d.hf_split, columns={d.text_column: "data.text_column"},
                              local="data.source: text with data.path", streaming=True)
        texts: Iterable[str] = (t for batch in iter_column(ds, d.text_column) for t in batch)
    elif d.source == "text":
        files = _files(d.path)
        if not files:
            _read_files(d)  # the error
        texts = (t for f in files for t in _file_texts(f, d.split_on))
    else:
        texts = (t for t, _ in synthetic_rows(d.num_sentences, d.seed))
    yield from (t for t in texts if t.strip())


class TextRange:
    """Texts ``start .. stop - 1`` of :func:`iter_texts`, read again on every iteration."""

    def __init__(self, d: DataConfig, start: int, stop: int) -> None:
        self.d, self.start, self.stop = d, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[str]:
        return islice(iter_texts(self.d), self.start, self.stop)

    def batches(self, size: int = 1000) -> Iterator[list[str]]:
        it = iter(self)
        while batch := list(islice(it, size)):
            yield batch


def stream_texts(d: DataConfig) -> dict[str, Any]:
    """:func:`read_texts` without holding the train texts: ``{"train": TextRange, "val": list}``
    (one pass counts the texts; the val split, the last ``val_fraction``, is kept in memory)."""
    count = sum(1 for _ in iter_texts(d))
    where = d.path or d.hf_name
    if count < 2:
        raise TkError(f"data: the corpus ({where}) has {count} non-empty text(s); the run needs at least 2 "
                      f"(one for each of the train and val splits); give a longer corpus")
    n_val = max(1, int(count * d.val_fraction))
    return {"train": TextRange(d, 0, count - n_val), "val": list(islice(iter_texts(d), count - n_val, None))}


def read_texts(d: DataConfig) -> dict[str, list[str]]:
    """``{"train": texts, "val": texts}``: the non-empty texts of ``d.source`` in order, the
    last ``d.val_fraction`` of them (at least one) the validation split.

    Raises:
        TkError: no text at all, or too few for both splits.
    """
    if d.source == "synthetic":
        texts = [t for t, _ in synthetic_rows(d.num_sentences, d.seed)]
    elif d.source == "hf":
        ds = load_hub_dataset(d.hf_name, d.hf_config, d.hf_split, columns={d.text_column: "data.text_column"},
                              local="data.source: text with data.path")
        texts = [t for batch in iter_column(ds, d.text_column) for t in batch]
    else:
        texts = _read_files(d)
    texts = [t for t in texts if t.strip()]
    where = d.path or d.hf_name or "synthetic"
    if len(texts) < 2:
        raise TkError(f"data: the corpus ({where}) has {len(texts)} non-empty text(s); the run needs at least 2 "
                      f"(one for each of the train and val splits); give a longer corpus")
    n_val = max(1, int(len(texts) * d.val_fraction))
    return {"train": texts[:-n_val], "val": texts[-n_val:]}


# -- sequences ------------------------------------------------------------------------------
def make_sequences(tokenizer: TextTokenizer, texts: list[str], max_len: int, pack: bool) -> tuple[list[list[int]], int]:
    """``[CLS] ... [SEP]`` id lists of at most ``max_len`` tokens, and how many texts were cut.

    ``pack``: the texts' tokens joined into one stream and cut into pieces of ``max_len - 2``
    (RoBERTa's FULL-SENTENCES: no padding, context across text boundaries; nothing is cut
    off). Else one text per sequence, longer ones truncated (counted).
    """
    cls, sep = tokenizer.token_id("[CLS]"), tokenizer.token_id("[SEP]")
    body = max_len - 2
    enc = tokenizer.encode_batch(texts, add_special_tokens=False)
    if not pack:
        cut = sum(len(ids) > body for ids in enc.ids)
        return [[cls, *ids[:body], sep] for ids in enc.ids if ids], cut
    stream = [i for ids in enc.ids for i in ids]
    return [[cls, *stream[s: s + body], sep] for s in range(0, len(stream), body)], 0


def mask_tokens(ids: torch.Tensor, special: torch.Tensor, mask_id: int, candidates: torch.Tensor, prob: float,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: each non-special token is chosen with probability ``prob``; a chosen
    token becomes ``[MASK]`` (80%), a random token (10%) or stays (10%), and is the only kind
    of position with a label.

    Args:
        ids: (B, T) token ids.
        special: (B, T) bool, True at tokens never chosen ([CLS], [SEP], [PAD]).
        mask_id: the id of ``[MASK]``.
        candidates: (N,) the ids a random replacement is drawn from (the non-special ones: a
            random [PAD] would turn into padding).
        prob: the chosen fraction.
        generator: the random numbers' source (None: torch's global one, seeded per batch by the
            engine in loader workers and restored on resume in the main process).

    Returns:
        ``(inputs, labels)``: the masked ids, and the original id at chosen positions, -100 elsewhere.
    """
    u = torch.rand(ids.shape, generator=generator)
    chosen = (u < prob) & ~special
    action = torch.rand(ids.shape, generator=generator)
    random_ids = candidates[torch.randint(len(candidates), ids.shape, generator=generator)]
    inputs = torch.where(chosen & (action < REPLACE_MASK), torch.full_like(ids, mask_id), ids)
    swap = chosen & (action >= REPLACE_MASK) & (action < REPLACE_MASK + REPLACE_RANDOM)
    inputs = torch.where(swap, random_ids, inputs)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    return inputs, labels


def pad_batch(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """(B, T) ids padded with ``pad_id`` to the longest sequence."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        out[row, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


class SequenceDataset(Dataset):
    """Items ``{"input_ids": list}`` (train: masked per batch in collate) or, with fixed
    masks (val), ``{"input_ids": list, "labels": list}``."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


class PackedTokens(Dataset):
    """``data.pack`` sequences cut from a token stream (the cached token file): item i is
    ``{"input_ids": [CLS] tokens[i * body : (i + 1) * body] [SEP]}`` (the last one shorter),
    what :func:`make_sequences` gives for the same texts."""

    def __init__(self, tokens: np.ndarray, max_len: int, cls: int, sep: int) -> None:
        self.tokens, self.body, self.cls, self.sep = tokens, max_len - 2, cls, sep

    def __len__(self) -> int:
        return -(-len(self.tokens) // self.body)

    def __getitem__(self, i: int) -> dict[str, Any]:
        piece = self.tokens[i * self.body: (i + 1) * self.body]
        return {"input_ids": [self.cls, *piece.tolist(), self.sep]}


def corpus_identity(d: DataConfig) -> dict[str, Any]:
    """What names the train texts in the token cache's key: the source and its settings, and
    for files each file's path, size and modification time (an edited file gets a new key)."""
    ident: dict[str, Any] = {"source": d.source, "val_fraction": d.val_fraction, "split": "train"}
    if d.source == "text":
        files = _files(d.path)
        ident.update(split_on=d.split_on, files=[(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                                                 for f in files])
    else:
        folder = Path(d.hf_name or "").expanduser()
        ident.update(hf_name=str(folder.resolve()) if folder.exists() else d.hf_name, hf_config=d.hf_config,
                     hf_split=d.hf_split, text_column=d.text_column)
    return ident
