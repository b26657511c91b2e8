"""Parallel text: the ``data:`` and ``tokenizer:`` sections, reading pairs (line-aligned files,
TSV/JSONL, Hugging Face datasets or the generated pairs), the tokenised dataset with its
filtering rules, and the collate."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any, Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from tk.core.data.stream import IterSource, StreamingDataset
from tk.core.errors import TkError
from tk.core.text import TextTokenizer, iter_parallel, load_hub_dataset, read_parallel, read_records
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
    src_code: str | None = None  # a pretrained translator's source language code (NLLB: eng_Latn); null = none
    tgt_code: str | None = None  # its target language code (NLLB: deu_Latn; multilingual opus-mt: >>deu<<); null = none
    streaming: bool = False  # files/tsv/jsonl/hf: read the train pairs in order as they come (train.batch_size pairs a batch; a pass counts them) instead of holding them in memory; resumes at the batch
    shuffle_buffer: int = 10000  # streaming: train pairs shuffled together


@dataclass(frozen=True)
class Framing:
    """How a pair becomes ids: source ``src_prefix + ids + [eos]``, target ``[bos] + tgt_prefix +
    ids + [eos]`` (``bos`` is the decoder's first token: Marian's pad, NLLB's ``</s>``)."""

    pad: int
    bos: int
    eos: int
    src_prefix: tuple[int, ...] = ()
    tgt_prefix: tuple[int, ...] = ()
    forced_bos: int | None = None  # the first generated token (NLLB: the target language code)
    forced_eos: bool = False  # the last allowed token is EOS (transformers' forced_eos_token_id)
    generation: dict[str, Any] = field(default_factory=dict)  # the model's generation_config.json

    @classmethod
    def of(cls, tok: TextTokenizer) -> Framing:
        """A tokenizer tk trained: ``<s>`` starts the decoder, no language codes."""
        pad, bos, eos = (tok.token_id(s) for s in SPECIALS[:3])
        return cls(pad, bos, eos)


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


def iter_hf(cfg: DataConfig, split: str, streaming: bool = False) -> Iterator[Pair]:
    """A Hugging Face ``datasets`` translation set (``translation: {src: ..., tgt: ...}`` rows)."""
    ds = load_hub_dataset(cfg.hf_name, cfg.hf_config, split={**HF_SPLIT, **cfg.hf_split}[split], streaming=streaming)
    for row in ds:
        r = row.get("translation", row)
        try:
            yield str(r[cfg.src_lang]), str(r[cfg.tgt_lang])
        except KeyError as e:
            raise TkError(f"data.src_lang/tgt_lang: {cfg.hf_name!r} has no language {e.args[0]!r}; "
                          f"set data.src_lang and data.tgt_lang to its language codes") from None


def iter_pairs(cfg: DataConfig, split: str, streaming: bool = False) -> Iterator[Pair]:
    """The raw (source, target) strings of ``split`` ("train", "val", "test"), in order, read as
    they come (``streaming``: a hub split is streamed rather than downloaded)."""
    if cfg.source in ("synthetic", "reverse"):
        make = synthetic_pairs if cfg.source == "synthetic" else reverse_pairs
        num = cfg.num_train if split == "train" else cfg.num_val
        yield from make(num, seed=cfg.seed * 3 + {"train": 0, "val": 1, "test": 2}[split])
        return
    if cfg.source == "hf":
        yield from iter_hf(cfg, split, streaming)
        return
    prefix = {"train": cfg.train_prefix, "val": cfg.val_prefix, "test": cfg.test_prefix}[split]
    if prefix is None:
        raise TkError(f"no {split} split: set data.{split}_prefix")
    key = f"data.{split}_prefix"
    if cfg.source == "tsv":
        rows = read_records(prefix, "tsv", key=key, fieldnames=("source", "target"))
        yield from ((r.data["source"], r.data["target"]) for r in rows)
    elif cfg.source == "jsonl":
        yield from read_jsonl(prefix, cfg.src_lang, cfg.tgt_lang, key)
    else:
        yield from iter_parallel(f"{prefix}.{cfg.src_lang}", f"{prefix}.{cfg.tgt_lang}", key=key)


def read_pairs(cfg: DataConfig, split: str) -> list[Pair]:
    """The raw (source, target) strings of ``split``, in memory."""
    if cfg.source not in ("synthetic", "reverse", "hf", "tsv", "jsonl"):  # both files checked before reading
        prefix = {"train": cfg.train_prefix, "val": cfg.val_prefix, "test": cfg.test_prefix}[split]
        if prefix is not None:
            return read_parallel(f"{prefix}.{cfg.src_lang}", f"{prefix}.{cfg.tgt_lang}", key=f"data.{split}_prefix")
    return list(iter_pairs(cfg, split))


def encode_pairs(pairs: Iterable[Pair], src_tok: TextTokenizer, tgt_tok: TextTokenizer, max_len: int,
                 dropped: dict[str, int] | None = None, chunk: int = 1000,
                 framing: Framing | None = None) -> Iterator[tuple[list[int], list[int], Pair]]:
    """``(source ids + EOS, BOS + target ids + EOS, the stripped pair)`` of the pairs kept (framed
    by ``framing``: language codes, the decoder's first token): one with an empty side is dropped
    (counted in ``dropped["empty"]``), one with more than ``max_len`` tokens on either side too
    (``dropped["too_long"]``). Encoded ``chunk`` pairs at a time."""
    dropped = {"empty": 0, "too_long": 0} if dropped is None else dropped
    f = framing or Framing.of(tgt_tok)
    src_prefix, tgt_prefix, eos = list(f.src_prefix), [f.bos, *f.tgt_prefix], f.eos
    it = iter(pairs)
    while batch := list(islice(it, chunk)):
        kept = [(s.strip(), t.strip()) for s, t in batch]
        nonempty = [(s, t) for s, t in kept if s and t]
        dropped["empty"] += len(kept) - len(nonempty)
        src_ids = src_tok.encode_batch([s for s, _ in nonempty], add_special_tokens=False).ids
        tgt_ids = tgt_tok.encode_batch([t for _, t in nonempty], add_special_tokens=False).ids
        for pair, si, ti in zip(nonempty, src_ids, tgt_ids):
            si, ti = src_prefix + si + [eos], tgt_prefix + ti + [eos]
            if len(si) > max_len or len(ti) > max_len:
                dropped["too_long"] += 1
                continue
            yield si, ti, pair


class ParallelDataset(Dataset):
    """Tokenised pairs: item i is ``{"id": i, "src": (Ts,) long, "tgt": (Tt,) long}`` where
    ``src`` ends with EOS and ``tgt`` is ``BOS ... EOS``; ``refs[i]`` is the raw target.

    Filtering rules (counted in ``dropped``): a pair whose source or target is empty after
    stripping whitespace is dropped (``"empty"``); a pair with more than ``max_len`` tokens
    on either side, BOS/EOS included, is dropped (``"too_long"``).
    """

    def __init__(self, pairs: list[Pair], src_tok: TextTokenizer, tgt_tok: TextTokenizer, max_len: int,
                 framing: Framing | None = None) -> None:
        self.src, self.tgt = [], []  # token ids: source + EOS, BOS + target + EOS
        self.sources, self.refs = [], []  # the raw (stripped) texts
        self.dropped = {"empty": 0, "too_long": 0}
        for si, ti, (s, t) in encode_pairs(pairs, src_tok, tgt_tok, max_len, self.dropped, max(len(pairs), 1), framing):
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


class PairItems:
    """Encoded pairs -> training items ``{"id": -1, "src", "tgt"}`` (training never reads the id)."""

    def __call__(self, encoded: tuple[list[int], list[int], Pair]) -> dict:
        return {"id": -1, "src": torch.tensor(encoded[0]), "tgt": torch.tensor(encoded[1])}


def _encoded(cfg: DataConfig, split: str, src_tok: TextTokenizer, tgt_tok: TextTokenizer,
             lowercase: bool, framing: Framing | None) -> Iterator[tuple[list[int], list[int], Pair]]:
    pairs = iter_pairs(cfg, split, streaming=True)
    if lowercase:
        pairs = ((s.lower(), t.lower()) for s, t in pairs)
    return encode_pairs(pairs, src_tok, tgt_tok, cfg.max_len, framing=framing)


def pair_stream(cfg: DataConfig, split: str, src_tok: TextTokenizer, tgt_tok: TextTokenizer,
                lowercase: bool, framing: Framing | None = None) -> StreamingDataset:
    """``split``'s pairs read in order (``data.streaming``), filtered as :class:`ParallelDataset`
    filters them; one pass counts the pairs kept.

    Raises:
        TkError: no pair is kept.
    """
    source = IterSource(partial(_encoded, cfg, split, src_tok, tgt_tok, lowercase, framing))
    if not len(source):
        raise TkError(f"the {split} split has no usable pairs (empty, or all longer than data.max_len="
                      f"{cfg.max_len} tokens); check the data or raise data.max_len")
    return StreamingDataset([source], PairItems(), cfg.shuffle_buffer)
