"""Parallel text: reading line-aligned files, TSV/JSONL, Hugging Face datasets or the
generated pairs, and the tokenised dataset with its filtering rules."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.plugins.translation.synthetic import reverse_pairs, synthetic_pairs

Pair = tuple[str, str]


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "reverse", "files", "tsv", "jsonl", "hf"] = "synthetic"  # where pairs come from
    src_lang: str = "en"  # source language code (file suffix, JSONL/HF key)
    tgt_lang: str = "de"  # target language code
    train_prefix: str = "data/train"  # files: {train_prefix}.{src_lang} / .{tgt_lang}; tsv/jsonl: the file itself
    val_prefix: str = "data/val"  # same for the validation split
    test_prefix: str | None = None  # same for the test split (tk eval --split test); null = none
    hf_name: str | None = None  # hf: dataset name on the hub, e.g. "wmt14"
    hf_config: str | None = None  # hf: its config, e.g. "de-en"
    hf_val_split: str = "validation"  # hf: the split used as "val"
    num_train: int = 20000  # synthetic/reverse: generated training pairs
    num_val: int = 500  # synthetic/reverse: generated validation pairs
    seed: int = 0  # synthetic/reverse: seed of the pairs (the grammar is fixed)
    max_len: int = 128  # pairs with more tokens on either side (BOS/EOS included) are dropped
    max_tokens: int = 4096  # padded tokens per batch (token-budget batching by length)
    lowercase: bool = False  # lowercase both sides before tokenising


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise TkError(f"data file not found: {path}; set data.train_prefix/data.val_prefix to where the files are")
    text = path.read_text(encoding="utf-8")
    return text.removesuffix("\n").split("\n") if text else []


def read_aligned(prefix: str, src_lang: str, tgt_lang: str) -> list[Pair]:
    """Line-aligned ``{prefix}.{src_lang}`` / ``{prefix}.{tgt_lang}``.

    Raises:
        TkError: a file is missing, or the two have different line counts.
    """
    src_path, tgt_path = Path(f"{prefix}.{src_lang}").expanduser(), Path(f"{prefix}.{tgt_lang}").expanduser()
    src, tgt = _read_lines(src_path), _read_lines(tgt_path)
    if len(src) != len(tgt):
        raise TkError(f"misaligned parallel files: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; "
                      f"each line of one must translate the same line of the other")
    return list(zip(src, tgt))


def read_tsv(path: str) -> list[Pair]:
    """A TSV file, one pair per line: ``source<TAB>target``."""
    p = Path(path).expanduser()
    out = []
    for i, row in enumerate(csv.reader(_read_lines(p), delimiter="\t", quoting=csv.QUOTE_NONE), 1):
        if len(row) != 2:
            raise TkError(f"{p} line {i}: expected 2 tab-separated fields (source, target), got {len(row)}")
        out.append((row[0], row[1]))
    return out


def read_jsonl(path: str, src_lang: str, tgt_lang: str) -> list[Pair]:
    """A JSONL file, one ``{"<src_lang>": ..., "<tgt_lang>": ...}`` object per line
    (or ``{"translation": {...}}``, the Hugging Face layout)."""
    p = Path(path).expanduser()
    out = []
    for i, line in enumerate(_read_lines(p), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TkError(f"{p} line {i}: not JSON ({e})") from None
        obj = obj.get("translation", obj)
        if src_lang not in obj or tgt_lang not in obj:
            raise TkError(f"{p} line {i}: needs keys {src_lang!r} and {tgt_lang!r} (data.src_lang/tgt_lang), "
                          f"got {sorted(obj)}")
        out.append((str(obj[src_lang]), str(obj[tgt_lang])))
    return out


def read_hf(cfg: DataConfig, split: str) -> list[Pair]:
    """A Hugging Face ``datasets`` translation set (``translation: {src: ..., tgt: ...}`` rows)."""
    import datasets  # lazy: heavy, and only this source needs it

    if not cfg.hf_name:
        raise TkError("data.source: hf needs data.hf_name (e.g. wmt14) and data.hf_config (e.g. de-en)")
    name = {"train": "train", "val": cfg.hf_val_split, "test": "test"}[split]
    ds = datasets.load_dataset(cfg.hf_name, cfg.hf_config, split=name)
    rows = ds["translation"] if "translation" in ds.column_names else ds
    return [(str(r[cfg.src_lang]), str(r[cfg.tgt_lang])) for r in rows]


def read_pairs(cfg: DataConfig, split: str) -> list[Pair]:
    """The raw (source, target) strings of ``split`` ("train", "val", "test")."""
    if cfg.source in ("synthetic", "reverse"):
        make = synthetic_pairs if cfg.source == "synthetic" else reverse_pairs
        num = cfg.num_train if split == "train" else cfg.num_val
        return make(num, seed=cfg.seed * 3 + {"train": 0, "val": 1, "test": 2}[split])
    if cfg.source == "hf":
        return read_hf(cfg, split)
    prefix = {"train": cfg.train_prefix, "val": cfg.val_prefix, "test": cfg.test_prefix}[split]
    if prefix is None:
        raise TkError(f"no {split} split: set data.{split}_prefix")
    if cfg.source == "tsv":
        return read_tsv(prefix)
    if cfg.source == "jsonl":
        return read_jsonl(prefix, cfg.src_lang, cfg.tgt_lang)
    return read_aligned(prefix, cfg.src_lang, cfg.tgt_lang)


class ParallelDataset(Dataset):
    """Tokenised pairs: item i is ``{"id": i, "src": (Ts,) long, "tgt": (Tt,) long}`` where
    ``src`` ends with EOS and ``tgt`` is ``BOS ... EOS``; ``refs[i]`` is the raw target.

    Filtering rules (counted in ``dropped``): a pair whose source or target is empty after
    stripping whitespace is dropped (``"empty"``); a pair with more than ``max_len`` tokens
    on either side, BOS/EOS included, is dropped (``"too_long"``).
    """

    def __init__(self, pairs: list[Pair], encode_src, encode_tgt, bos: int, eos: int, max_len: int) -> None:
        self.src: list[list[int]] = []
        self.tgt: list[list[int]] = []
        self.refs: list[str] = []
        self.sources: list[str] = []
        self.dropped = {"empty": 0, "too_long": 0}
        kept = [(s.strip(), t.strip()) for s, t in pairs]
        nonempty = [(s, t) for s, t in kept if s and t]
        self.dropped["empty"] = len(kept) - len(nonempty)
        src_ids = encode_src([s for s, _ in nonempty])
        tgt_ids = encode_tgt([t for _, t in nonempty])
        for (s, t), si, ti in zip(nonempty, src_ids, tgt_ids):
            si, ti = si + [eos], [bos] + ti + [eos]
            if len(si) > max_len or len(ti) > max_len:
                self.dropped["too_long"] += 1
                continue
            self.src.append(si)
            self.tgt.append(ti)
            self.sources.append(s)
            self.refs.append(t)
        self.lengths = np.array([[len(a), len(b)] for a, b in zip(self.src, self.tgt)], dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "src": torch.tensor(self.src[i]), "tgt": torch.tensor(self.tgt[i])}


def pad_stack(seqs: list[torch.Tensor], pad: int) -> torch.Tensor:
    """Right-pad 1-D tensors into (B, T_max)."""
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad)


def collate_pairs(samples: list[dict], pad: int) -> dict:
    """Batch dict: ``src`` (B, Ts), ``tgt_in`` (B, Tt-1) = ``BOS y1 .. yn`` (teacher forcing),
    ``tgt_out`` (B, Tt-1) = ``y1 .. yn EOS``, padded with ``pad``; ``id`` (B,)."""
    tgt = pad_stack([s["tgt"] for s in samples], pad)
    return {"id": torch.tensor([s["id"] for s in samples]), "src": pad_stack([s["src"] for s in samples], pad),
            "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}
