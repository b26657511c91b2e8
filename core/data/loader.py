"""Data loading helpers shared by all tasks: the loader spec the engine hands to a
task, and a default loader that shards across processes."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, SequentialSampler


@dataclass
class LoaderSpec:
    """How the engine wants a split loaded.

    Attributes:
        batch_size: samples per (micro-)batch on this process.
        shuffle: reshuffle every epoch (training).
        drop_last: drop the last incomplete batch (training; keeps batch shapes fixed).
        seed: base seed; the epoch is added so each epoch has its own order.
        num_workers: DataLoader worker processes.
        rank: this process's rank, world_size: number of processes (1 = not distributed).
        pin_memory: pin host memory (CUDA).
    """

    batch_size: int
    shuffle: bool = False
    drop_last: bool = False
    seed: int = 0
    num_workers: int = 0
    rank: int = 0
    world_size: int = 1
    pin_memory: bool = False


def build_sampler(dataset: Dataset, spec: LoaderSpec) -> torch.utils.data.Sampler:
    """A sampler that shards across ``spec.world_size`` processes and whose order is a
    pure function of (seed, epoch), so a resumed run sees the same batches."""
    if spec.world_size > 1 and not spec.shuffle and not spec.drop_last:
        return ShardSampler(dataset, rank=spec.rank, world_size=spec.world_size)
    if spec.world_size > 1:
        return DistributedSampler(
            dataset, num_replicas=spec.world_size, rank=spec.rank, shuffle=spec.shuffle,
            seed=spec.seed, drop_last=spec.drop_last,
        )
    if spec.shuffle:
        return EpochSeededRandomSampler(dataset, seed=spec.seed)
    return SequentialSampler(dataset)


class EpochSeededRandomSampler(RandomSampler):
    """Random order seeded by (seed, epoch) with the ``set_epoch`` of DistributedSampler."""

    def __init__(self, dataset: Dataset, seed: int = 0) -> None:
        super().__init__(dataset)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=g).tolist()


class ShardSampler(Sampler[int]):
    """Evaluation sharding without padding: rank r reads items r, r + W, r + 2W, ...

    DistributedSampler pads the last round with repeated items so every rank has the
    same count; summed evaluation metrics would then count those items twice.
    """

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        self.size, self.rank, self.world_size = len(dataset), rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


def seed_worker(worker_id: int, seed: int, rank: int, sampler: Sampler) -> None:
    """Seed a loader worker from (seed, epoch, rank, worker) alone, so the random
    augmentations of a pass are the same in a resumed run as in the original one."""
    epoch = getattr(sampler, "epoch", 0)  # the sampler was copied into the worker at fork
    worker_seed = int(np.random.SeedSequence([seed, epoch, rank, worker_id]).generate_state(1)[0])
    random.seed(worker_seed)
    np.random.seed(worker_seed)
    torch.manual_seed(worker_seed)


def build_loader(dataset: Dataset, spec: LoaderSpec, collate_fn: Callable[[list], Any] | None = None) -> DataLoader:
    """The default loader: sharded, epoch-seeded sampling, ``collate_fn`` batching."""
    sampler = build_sampler(dataset, spec)
    # Workers are re-created (and re-seeded by seed_worker) every pass rather than kept
    # alive, so their random state never depends on how many passes came before a resume.
    init = functools.partial(seed_worker, seed=spec.seed, rank=spec.rank, sampler=sampler) \
        if spec.num_workers > 0 else None
    return DataLoader(
        dataset,
        batch_size=spec.batch_size,
        sampler=sampler,
        drop_last=spec.drop_last,
        num_workers=spec.num_workers,
        collate_fn=collate_fn,
        pin_memory=spec.pin_memory,
        worker_init_fn=init,
    )
