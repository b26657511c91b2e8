"""Parallel text: the ``data:`` and ``tokenizer:`` sections, reading pairs (line-aligned files,
TSV/JSONL, Hugging Face datasets or the generated pairs), the tokenised dataset with its
filtering rules, and the collate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.core.text import TextTokenizer, load_hub_dataset, read_parallel, read_records
from tk.core.text import TokenizerConfig as TextTokenizerConfig
from tk.plugins.translation.synthetic import reverse_pairs, synthetic_pairs

Pair = tuple[str, str]
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # trained tokenizers give them ids 0, 1, 2, 3
HF_SPLIT = {"train": "train", "val": "validation", "test": "test"}  # tk split -> dataset split


@dataclass
class TokenizerConfig(TextTokenizerConfig):
    """The recipe's ``tokenizer:`` section (:class:`tk.core.text.TokenizerConfig`), plus ``joint``."""

    kind: Literal["bpe", "unigram"] = "bpe"  # bpe: byte-level BPE; unigram: Metaspace Unigram; trained on train
    joint: bool = True  # one vocabulary for both languages (needed by model.share_embeddings; tokenizer.path)


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
    hf_split: dict[str, str] = field(default_factory=lambda: dict(HF_SPLIT))  # hf: tk split -> dataset split
    num_train: int = 20000  # synthetic/reverse: generated training pairs
    num_val: int = 500  # synthetic/reverse: generated validation pairs
    seed: int = 0  # synthetic/reverse: seed of the pairs (the grammar is fixed)
    max_len: int = 128  # pairs with more tokens on either side (BOS/EOS included) are dropped
    max_tokens: int = 4096  # padded tokens per batch (token-budget batching by length)


def read_jsonl(path: str, src_lang: str, tgt_lang: str, key: str = "data.train_prefix") -> list[Pair]:
    """A JSONL file, one ``{"<src_lang>": ..., "<tgt_lang>": ...}`` object per line
    (or ``{"translation": {...}}``, the Hugging Face layout)."""
    out = []
    for rec in read_records(path, "jsonl", key=key):
        obj = rec.data.get("translation", rec.data)
        if not isinstance(obj, dict) or src_lang not in obj or tgt_lang not in obj:
            raise TkError(f"{rec.where}: needs keys {src_lang!r} and {tgt_lang!r} (data.src_lang/tgt_lang), "
                          f"got {sorted(obj) if isinstance(obj, dict) else obj!r}")
        out.append((str(obj[src_lang]), str(obj[tgt_lang])))
    return out


def read_hf(cfg: DataConfig, split: str) -> list[Pair]:
    """A Hugging Face ``datasets`` translation set (``translation: {src: ..., tgt: ...}`` rows)."""
    ds = load_hub_dataset(cfg.hf_name, cfg.hf_config, split={**HF_SPLIT, **cfg.hf_split}[split])
    rows = ds["translation"] if "translation" in ds.column_names else ds
    try:
        return [(str(r[cfg.src_lang]), str(r[cfg.tgt_lang])) for r in rows]
    except KeyError as e:
        raise TkError(f"data.src_lang/tgt_lang: {cfg.hf_name!r} has no language {e.args[0]!r}; "
                      f"set data.src_lang and data.tgt_lang to its language codes") from None


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
    key = f"data.{split}_prefix"
    if cfg.source == "tsv":
        rows = read_records(prefix, "tsv", key=key, fieldnames=("source", "target"))
        return [(r.data["source"], r.data["target"]) for r in rows]
    if cfg.source == "jsonl":
        return read_jsonl(prefix, cfg.src_lang, cfg.tgt_lang, key)
    return read_parallel(f"{prefix}.{cfg.src_lang}", f"{prefix}.{cfg.tgt_lang}", key=key)


class ParallelDataset(Dataset):
    """Tokenised pairs: item i is ``{"id": i, "src": (Ts,) long, "tgt": (Tt,) long}`` where
    ``src`` ends with EOS and ``tgt`` is ``BOS ... EOS``; ``refs[i]`` is the raw target.

    Filtering rules (counted in ``dropped``): a pair whose source or target is empty after
    stripping whitespace is dropped (``"empty"``); a pair with more than ``max_len`` tokens
    on either side, BOS/EOS included, is dropped (``"too_long"``).
    """

    def __init__(self, pairs: list[Pair], src_tok: TextTokenizer, tgt_tok: TextTokenizer, max_len: int) -> None:
        self.src, self.tgt = [], []  # token ids: source + EOS, BOS + target + EOS
        self.sources, self.refs = [], []  # the raw (stripped) texts
        bos, eos = tgt_tok.token_id(BOS), tgt_tok.token_id(EOS)
        kept = [(s.strip(), t.strip()) for s, t in pairs]
        nonempty = [(s, t) for s, t in kept if s and t]
        self.dropped = {"empty": len(kept) - len(nonempty), "too_long": 0}
        src_ids = src_tok.encode_batch([s for s, _ in nonempty], add_special_tokens=False).ids
        tgt_ids = tgt_tok.encode_batch([t for _, t in nonempty], add_special_tokens=False).ids
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


def collate_pairs(samples: list[dict], pad: int) -> dict:
    """Batch dict: ``src`` (B, Ts), ``tgt_in`` (B, Tt-1) = ``BOS y1 .. yn`` (teacher forcing),
    ``tgt_out`` (B, Tt-1) = ``y1 .. yn EOS``, padded with ``pad``; ``id`` (B,)."""
    tgt = pad_sequence([s["tgt"] for s in samples], batch_first=True, padding_value=pad)
    src = pad_sequence([s["src"] for s in samples], batch_first=True, padding_value=pad)
    return {"id": torch.tensor([s["id"] for s in samples]), "src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}
