"""The resumable stream of training batches (and the fixed batches of ``train.overfit_batches``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from tk.core.distributed import comm_device
from tk.core.errors import TkError
from tk.core.run.rng import preserved_rng

__all__ = ["BatchStream", "FixedBatches", "agreed_length", "loader_length"]

DATA_WAIT_NOTE = 0.10  # share of training time spent waiting for batches above which a run is told once


def loader_length(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without one (an ``IterableDataset``, or an
    endless sampler such as :class:`tk.core.data.samplers.RandomIndexSampler`)."""
    try:
        return len(loader)
    except TypeError:
        return None


def agreed_length(loader: Any, world_size: int) -> tuple[int | None, int | None]:
    """(fewest, most) batches per pass over all processes (a collective when
    ``world_size > 1``); (None, None) for a loader without a length."""
    n = loader_length(loader)
    if world_size == 1 or n is None:
        return n, n
    buf = torch.tensor([n, -n], device=comm_device())
    dist.all_reduce(buf, op=dist.ReduceOp.MIN)
    return int(buf[0]), -int(buf[1])


class BatchStream:
    """The training batches, pass after pass, with a position that checkpoints can hold.

    Each pass is cut to ``batches_per_epoch`` (a multiple of ``grad_accum``): the last
    few micro-batches that cannot fill an update are dropped, so an update never mixes
    two passes, and ``grad_accum=4, batch_size=8`` sees exactly the samples of
    ``grad_accum=1, batch_size=32`` in every update (same sampler order). With
    ``batches_per_epoch=None`` (a loader without a length) a pass lasts until the loader
    is exhausted, which an endless sampler never is.

    The order of a pass is a pure function of (seed, epoch) (the samplers of
    ``tk.core.data``). On resume mid-pass, a resumable sampler (``load_state_dict``: the
    batch samplers of ``tk.core.data.samplers``, the item samplers of
    ``tk.core.data.loader`` under a DataLoader of the same batch size) starts after the
    consumed batches by index: no item of them is loaded or collated. Any other loader is
    replayed (its consumed batches loaded and dropped). RNG states are preserved around
    both, and loader workers are seeded per batch (``tk.core.data.loader.WorkerSeeding``),
    so the batches and random numbers after a resume match an uninterrupted run.

    Args:
        loader: the training loader (its sampler, batch sampler or IterableDataset gets
            the pass number through ``set_epoch`` where they have one).
        batches_per_epoch: micro-batches used per pass (None: all the loader yields).
        seed: base seed for DataLoader worker seeds; rank: the process rank.
        echo: where :meth:`note_starvation` says its line.
    """

    def __init__(self, loader, batches_per_epoch: int | None, seed: int = 0, rank: int = 0,
                 echo: Callable[[str], None] = print) -> None:
        self.loader, self.echo = loader, echo
        self.batches_per_epoch = batches_per_epoch
        self.seed, self.rank = seed, rank
        self.epoch = 0  # passes started
        self.batch = 0  # batches consumed in the current pass
        self._it: Iterator | None = None
        self.waited = 0.0  # seconds next() spent fetching batches since the last pop_wait()
        self._windows = 0  # log windows seen by starvation_note (the first one has the workers' start-up)
        self._noted = False

    def pop_wait(self) -> float:
        """Seconds the training loop waited for batches since the previous call (the loader's
        workers could not keep ahead, or the main process loaded the batch itself)."""
        waited, self.waited = self.waited, 0.0
        return waited

    def note_starvation(self, data_wait: float) -> None:
        """Say once per run (``echo``) that the loader holds training back: ``data_wait`` (the
        share of a log window's training time spent waiting for batches) above
        ``DATA_WAIT_NOTE`` after the first window (which has the workers' start-up)."""
        self._windows += 1
        if self._noted or self._windows == 1 or data_wait <= DATA_WAIT_NOTE:
            return
        self._noted = True
        workers = getattr(self.loader, "num_workers", 0)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.echo(f"note: training waited for its batches {100 * data_wait:.0f}% of the time (data_wait in "
                  f"metrics.jsonl); raise train.num_workers (now {workers}; {cores} CPU cores here) or do less per "
                  f"sample in the loader (image_classification: data.pipeline=device augments on the device)")

    def state_dict(self) -> dict[str, Any]:
        lanes = self._stream_lanes()
        return {"epoch": self.epoch, "batch": self.batch} | ({"stream_lanes": lanes} if lanes else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position. A streamed pass (``StreamingDataset``) was ordered for
        its processes and loader workers: resuming it with others is refused (one line)."""
        saved, lanes = state.get("stream_lanes"), self._stream_lanes()
        if saved is not None and lanes is not None and list(saved) != list(lanes):
            raise TkError(f"the streamed run was saved with train.num_workers={saved[0]} on {saved[1]} process(es) "
                          f"and resumes with {lanes[0]} on {lanes[1]}; the order of a stream depends on both, so "
                          f"resume with train.num_workers={saved[0]} on {saved[1]} process(es)")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._it = None

    def _stream_lanes(self) -> list[int] | None:
        """[loader workers, processes] of a streamed loader (its order depends on them), else None."""
        dataset = getattr(self.loader, "dataset", None)
        if not isinstance(dataset, IterableDataset) or not hasattr(dataset, "world_size"):
            return None
        return [int(getattr(self.loader, "num_workers", 0)), int(dataset.world_size)]

    def next(self) -> Any:
        """The next micro-batch (on the host); the time it took counts in :meth:`pop_wait`."""
        start = time.perf_counter()
        try:
            return self._next()
        finally:
            self.waited += time.perf_counter() - start

    def _next(self) -> Any:
        for _ in range(2):
            if self.batches_per_epoch is not None and self.batch >= self.batches_per_epoch:
                self._next_pass()
            if self._it is None:
                self._it = self._open()
            try:
                batch = next(self._it)
            except StopIteration:  # the loader gave fewer batches than expected this pass
                self._next_pass()
                continue
            self.batch += 1
            return batch
        raise TkError(f"the training loader yielded no batches in pass {self.epoch}; check the train split")

    def _next_pass(self) -> None:
        self.epoch, self.batch, self._it = self.epoch + 1, 0, None

    def _open(self) -> Iterator:
        with preserved_rng():
            dataset = getattr(self.loader, "dataset", None)
            parts = (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None),
                     dataset if isinstance(dataset, IterableDataset) else None)  # it orders itself
            for part in parts:
                if hasattr(part, "set_epoch"):
                    part.set_epoch(self.epoch)
            seeked = self.batch == 0 or self._seek()
            if isinstance(self.loader, DataLoader):
                # DataLoader draws its worker seed from the global RNG unless it has a
                # generator; a (seed, rank, epoch) one keeps the global stream untouched.
                self.loader.generator = torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + self.epoch) * 1_009 + self.rank)
            it = iter(self.loader)
            if not seeked:  # the loader cannot start mid-pass: replay the consumed batches
                for _ in range(self.batch):
                    next(it)
        return it

    def _seek(self) -> bool:
        """Start the pass at ``self.batch`` by index, if the loader's sampler can."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        sampler = getattr(self.loader, "sampler", None)
        dataset = getattr(self.loader, "dataset", None)
        if isinstance(dataset, IterableDataset):  # a StreamingDataset positions itself
            sampler, batch_sampler = dataset, None
        if callable(getattr(batch_sampler, "load_state_dict", None)):
            target = batch_sampler
        elif callable(getattr(sampler, "load_state_dict", None)) \
                and getattr(sampler, "batch_size", None) == getattr(self.loader, "batch_size", False):
            target = sampler  # an item sampler counting in batches of the loader's size
        else:
            return False
        target.load_state_dict({"epoch": self.epoch, "batch": self.batch})
        return True


class FixedBatches:
    """``train.overfit_batches``: the first ``n`` batches of pass 0, repeated forever
    (a sanity check: a model that cannot drive their loss near zero has a bug)."""

    def __init__(self, loader, n: int) -> None:
        with preserved_rng():
            if isinstance(loader, DataLoader):
                loader.generator = torch.Generator().manual_seed(0)
            it = iter(loader)
            self.batches = [b for _, b in zip(range(n), it)]
        if len(self.batches) < n:
            raise TkError(f"train.overfit_batches: the train split has only {len(self.batches)} batches, "
                          f"asked for {n}; lower train.overfit_batches")
        self.epoch = 0
        self.batch = 0  # batches served in total

    def pop_wait(self) -> float:
        """The batches are held in memory: no wait."""
        return 0.0

    def note_starvation(self, data_wait: float) -> None:
        """Nothing to say: no loader."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def next(self) -> Any:
        batch = self.batches[self.batch % len(self.batches)]
        self.batch += 1
        self.epoch = self.batch // len(self.batches)
        return batch

