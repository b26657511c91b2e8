"""Data loading helpers shared by all tasks: the loader spec the engine hands to a
task, and a default loader that shards across processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler


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


def build_loader(dataset: Dataset, spec: LoaderSpec, collate_fn: Callable[[list], Any] | None = None) -> DataLoader:
    """The default loader: sharded, epoch-seeded sampling, ``collate_fn`` batching."""
    return DataLoader(
        dataset,
        batch_size=spec.batch_size,
        sampler=build_sampler(dataset, spec),
        drop_last=spec.drop_last,
        num_workers=spec.num_workers,
        collate_fn=collate_fn,
        pin_memory=spec.pin_memory,
        persistent_workers=spec.num_workers > 0,
    )
