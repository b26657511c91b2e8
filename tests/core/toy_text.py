"""A toy text task for tk's sampler tests (installed as plugin ``toy_text`` by the tests):
per-token tagging of sequences with skewed (lognormal) lengths, batched by the default
loader, a token budget, endless random indices, or an unsized IterableDataset."""

import os
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tk.core import RandomIndexSampler, TokenBudgetBatchSampler, build_loader
from tk.core.metrics import Accuracy
from tk.core.task import StepOutput, Task

FETCH_LOG = "TK_TOY_FETCH_LOG"  # env var: a file every train __getitem__ appends its index to


@dataclass
class ToyTextData:
    num_train: int = 200  # training sequences
    num_val: int = 40  # validation sequences
    vocab_size: int = 16  # token ids 1..vocab_size-1 (0 = PAD)
    mean_log_len: float = 2.0  # lengths are 1 + lognormal(mean_log_len, 0.8) tokens, capped at max_len
    max_len: int = 60  # longest sequence
    batching: Literal["default", "tokens", "random", "iterable"] = "default"  # how the train split is batched
    max_tokens: int = 128  # padded tokens per batch (batching=tokens)
    mask_prob: float = 0.1  # augmentation in __getitem__: tokens replaced by 0 (numpy RNG)
    delay: float = 0.0  # seconds slept per batch, so tests can signal a run mid-way
    seed: int = 0  # data seed


@dataclass
class ToyTextModel:
    hidden: int = 32  # hidden width
    dropout: float = 0.1  # dropout after the embedding


def make_sequences(n: int, d: ToyTextData, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(1 + rng.lognormal(d.mean_log_len, 0.8, n).astype(int), d.max_len)
    return [torch.from_numpy(rng.integers(1, d.vocab_size, int(k))) for k in lengths]


class Sequences(Dataset):
    """Token sequences with random masking; optionally logs every item it loads."""

    def __init__(self, seqs: list[torch.Tensor], mask_prob: float, log: str | None) -> None:
        self.seqs, self.mask_prob, self.log = seqs, mask_prob, log
        self.lengths = [len(s) for s in seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
        tgt = self.seqs[i]
        drop = torch.from_numpy(np.random.rand(len(tgt)) < self.mask_prob)
        return {"src": tgt.masked_fill(drop, 0), "tgt": tgt}


class SequenceStream(IterableDataset):
    """One pass over ``Sequences`` as an IterableDataset (no ``__len__``), sharded over
    ranks and workers."""

    def __init__(self, items: Sequences, rank: int, world_size: int) -> None:
        self.items, self.rank, self.world_size = items, rank, world_size

    def __iter__(self):
        info = get_worker_info()
        shard, shards = (self.rank, self.world_size) if info is None else \
            (self.rank * info.num_workers + info.id, self.world_size * info.num_workers)
        for i in range(shard, len(self.items), shards):
            yield self.items[i]


class ToyTextTask(Task):
    """Per-token tagging of skewed-length sequences (test plugin for samplers)."""

    name = "toy_text"
    DataConfig = ToyTextData
    ModelConfig = ToyTextModel

    def build_dataset(self, split):
        d = self.data
        n = d.num_train if split == "train" else d.num_val
        seqs = make_sequences(n, d, d.seed + (1 if split == "train" else 2))
        return Sequences(seqs, d.mask_prob if split == "train" else 0.0,
                         os.environ.get(FETCH_LOG) if split == "train" else None)

    def build_loader(self, split, spec):
        d, dataset = self.data, self.build_dataset(split)
        if d.batching == "tokens":  # both splits: evaluation then reads every example once
            sampler = TokenBudgetBatchSampler.from_spec(spec, dataset.lengths, d.max_tokens)
            return build_loader(dataset, spec, self.collate, batch_sampler=sampler)
        if split == "train" and d.batching == "random":
            sampler = RandomIndexSampler.from_spec(spec, len(dataset))
            return build_loader(dataset, spec, self.collate, batch_sampler=sampler)
        if split == "train" and d.batching == "iterable":
            return build_loader(SequenceStream(dataset, spec.rank, spec.world_size), spec, self.collate)
        return build_loader(dataset, spec, self.collate)

    def collate(self, samples):
        if self.data.delay:
            time.sleep(self.data.delay)
        src = nn.utils.rnn.pad_sequence([s["src"] for s in samples], batch_first=True)  # (B, T)
        tgt = nn.utils.rnn.pad_sequence([s["tgt"] for s in samples], batch_first=True)
        labels = torch.where(tgt == 0, torch.full_like(tgt, -100), (tgt * 3 + 1) % self.data.vocab_size)
        return {"src": src, "labels": labels}

    def build_model(self):
        d, m = self.data, self.model_cfg
        return nn.Sequential(nn.Embedding(d.vocab_size, m.hidden), nn.Dropout(m.dropout),
                             nn.Linear(m.hidden, m.hidden), nn.Tanh(), nn.Linear(m.hidden, d.vocab_size))

    def loss(self, model, batch):
        logits = model(batch["src"])  # (B, T, V)
        keep = batch["labels"] != -100
        loss = nn.functional.cross_entropy(logits[keep].float(), batch["labels"][keep], reduction="sum")
        return StepOutput(loss=loss, num_items=keep.sum(), outputs=logits)

    def build_metrics(self, split):
        return {"acc": Accuracy(topk=(1,), ignore_index=-100)}
