"""Data loading helpers shared by all tasks: the loader spec the engine hands to a task,
resumable item samplers, per-batch seeding of loader workers, and the default loader."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    default_collate,
    get_worker_info,
)

from tk.core.data.stream import StreamingDataset

__all__ = [
    "DistributedEpochSampler",
    "EpochSeededRandomSampler",
    "LoaderSpec",
    "ShardSampler",
    "WorkerSeeding",
    "build_loader",
    "build_sampler",
]


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


class _Resumable:
    """The position of an item sampler, counted in batches of ``batch_size`` items: a pass
    can start after its first ``start`` batches without producing them (resume)."""

    batch_size: int
    epoch: int
    start: int

    def _init_position(self, batch_size: int) -> None:
        self.batch_size, self.epoch, self.start = batch_size, 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Start a fresh pass ``epoch`` (the seed of its order)."""
        self.epoch, self.start = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """The position the next pass starts at (the engine records consumed batches itself)."""
        return {"epoch": self.epoch, "batch": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next pass is ``state["epoch"]``, from batch ``state["batch"]`` on."""
        self.epoch, self.start = int(state.get("epoch", self.epoch)), int(state["batch"])

    def _pass_order(self) -> list[int]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        order = self._pass_order()
        yield from order[self.start * self.batch_size:]
        self.start = 0  # a finished pass: the next one starts from its beginning


class EpochSeededRandomSampler(_Resumable, Sampler[int]):
    """Random order seeded by (seed, epoch) with the ``set_epoch`` of DistributedSampler;
    resumable in batches of ``batch_size``."""

    def __init__(self, dataset: Dataset, seed: int = 0, batch_size: int = 1) -> None:
        self.data_source, self.seed = dataset, seed
        self._init_position(batch_size)

    def _pass_order(self) -> list[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.data_source), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.data_source)


class DistributedEpochSampler(_Resumable, DistributedSampler):
    """torch's DistributedSampler (same order and padding), resumable in batches of ``batch_size``."""

    def __init__(self, dataset: Dataset, *, batch_size: int = 1, **options: Any) -> None:
        DistributedSampler.__init__(self, dataset, **options)
        self._init_position(batch_size)

    def _pass_order(self) -> list[int]:
        return list(DistributedSampler.__iter__(self))


class ShardSampler(_Resumable, Sampler[int]):
    """Sharding without padding: rank r reads items r, r + W, r + 2W, ... in order.

    DistributedSampler pads the last round with repeated items so every rank has the
    same count; summed evaluation metrics would then count those items twice.
    """

    def __init__(self, dataset: Dataset, rank: int = 0, world_size: int = 1, batch_size: int = 1) -> None:
        self.size, self.rank, self.world_size = len(dataset), rank, world_size
        self._init_position(batch_size)

    def _pass_order(self) -> list[int]:
        return list(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


def build_sampler(dataset: Dataset, spec: LoaderSpec) -> Sampler[int]:
    """A resumable sampler that shards across ``spec.world_size`` processes and whose order
    is a pure function of (seed, epoch), so a resumed run sees the same batches."""
    if not spec.shuffle and (spec.world_size == 1 or not spec.drop_last):
        return ShardSampler(dataset, rank=spec.rank, world_size=spec.world_size, batch_size=spec.batch_size)
    if spec.world_size > 1:
        return DistributedEpochSampler(dataset, batch_size=spec.batch_size, num_replicas=spec.world_size,
                                       rank=spec.rank, shuffle=spec.shuffle, seed=spec.seed, drop_last=spec.drop_last)
    return EpochSeededRandomSampler(dataset, seed=spec.seed, batch_size=spec.batch_size)


class WorkerSeeding:
    """Seeds python, numpy and torch in loader workers once per batch: batch i of pass e on
    rank r is loaded right after seeding from (seed, e, r, i), whichever worker loads it,
    however many workers there are and wherever the pass started (a resumed pass).

    DataLoader hands the batches of an iterator to its workers in turn (``in_order``), so
    worker w loads batches start + w, start + w + W, ...; ``start`` (and ``epoch``) are read
    from the sampler's copy in the worker. The seeding for the next batch happens after
    each collate. Pass :meth:`init_worker` as ``worker_init_fn`` and :meth:`collate` as
    ``collate_fn``.

    Args:
        seed: base seed; rank: this process.
        sampler: the (batch) sampler whose ``epoch`` and ``start`` give the position.
        collate_fn: the task's collate (None: torch's default).
    """

    def __init__(self, seed: int, rank: int, sampler: Any, collate_fn: Callable[[list], Any] | None) -> None:
        self.seed, self.rank, self.sampler = seed, rank, sampler
        self.collate_fn = collate_fn or default_collate
        self._next, self._stride = 0, 1

    def init_worker(self, worker_id: int) -> None:
        info = get_worker_info()
        self._next = getattr(self.sampler, "start", 0) + worker_id
        self._stride = info.num_workers if info is not None else 1
        self._seed()

    def collate(self, samples: list) -> Any:
        batch = self.collate_fn(samples)
        self._next += self._stride
        self._seed()
        return batch

    def _seed(self) -> None:
        epoch = getattr(self.sampler, "epoch", 0)
        keys = [k % 2**64 for k in (self.seed, epoch, self.rank, self._next)]  # SeedSequence takes no negatives
        state = np.random.SeedSequence(keys).generate_state(2)
        random.seed(int(state[0]))
        np.random.seed(int(state[1]))
        torch.manual_seed(int(state[0]))


def build_loader(dataset: Dataset, spec: LoaderSpec, collate_fn: Callable[[list], Any] | None = None, *,
                 batch_sampler: Sampler[list[int]] | None = None) -> DataLoader:
    """The default loader: resumable sharded, epoch-seeded sampling (or ``batch_sampler``,
    e.g. a :class:`tk.core.data.samplers.TokenBudgetBatchSampler`), ``collate_fn`` batching,
    and workers seeded per batch (:class:`WorkerSeeding`).

    A :class:`tk.core.data.stream.StreamingDataset` is bound to the spec (rank, batch size,
    seed) and resumes at a batch like the samplers. Any other ``IterableDataset`` gets no
    sampler: it must shard itself across ranks
    (``spec.rank``/``spec.world_size``) and workers (``torch.utils.data.get_worker_info``);
    the engine calls its ``set_epoch`` (if any) each pass and resumes it by replaying the
    consumed batches (it cannot start mid-pass).

    Args:
        dataset: the split's dataset.
        spec: the engine's :class:`LoaderSpec`.
        collate_fn: samples -> batch dict (None: torch's default collation).
        batch_sampler: yields lists of indices; replaces ``spec.batch_size``, ``shuffle``
            and ``drop_last`` (the sampler honours seed, rank and world size itself).
    """
    if batch_sampler is not None:
        batching: dict[str, Any] = {"batch_sampler": batch_sampler}
        position = batch_sampler
    elif isinstance(dataset, IterableDataset):
        if isinstance(dataset, StreamingDataset):  # it splits itself by rank and worker, resumable
            dataset.bind(batch_size=spec.batch_size, shuffle=spec.shuffle, drop_last=spec.drop_last, seed=spec.seed,
                         rank=spec.rank, world_size=spec.world_size)
        batching, position = {"batch_size": spec.batch_size, "drop_last": spec.drop_last}, dataset
    else:
        position = build_sampler(dataset, spec)
        batching = {"batch_size": spec.batch_size, "sampler": position, "drop_last": spec.drop_last}
    init = None
    if spec.num_workers > 0:
        # Workers are re-created (and re-seeded) every pass rather than kept alive, so their
        # random numbers never depend on how many passes came before a resume.
        seeding = WorkerSeeding(spec.seed, spec.rank, position, collate_fn)
        init, collate_fn = seeding.init_worker, seeding.collate
    return DataLoader(dataset, num_workers=spec.num_workers, collate_fn=collate_fn, pin_memory=spec.pin_memory,
                      worker_init_fn=init, **batching)
