"""Streaming datasets: samples read lazily, in order, from sources that cannot be indexed at
random cheaply (tar shards on a remote filesystem, a hub dataset streamed over the network),
split across processes and loader workers, and resumed exactly at a batch.

A pass over a :class:`StreamingDataset` is fixed by (seed, epoch):

1. the sources are put in a random order (training) and read as one sequence;
2. rank r of W takes the r-th of W equal contiguous ranges of it (training drops the
   remainder, so every rank has the same number of batches; evaluation keeps every sample);
3. with K loader workers (1 without), the rank's batches are dealt to K lanes (batch i to
   lane i mod K), each lane a contiguous part of the rank's range that one worker reads
   sequentially, so every raw sample is read once, by one worker;
4. a lane is cut into blocks of ``buffer_size`` samples, each put in a random order (a
   shuffle buffer whose contents depend only on the position), and its batches are
   consecutive samples of that order.

The order thus depends on (seed, epoch, processes, loader workers), as in litdata and
webdataset: resume with the same ``train.num_workers``. A pass can start at any batch: each
lane reads from the block of its first sample on, without loading or collating a batch
before the position (the engine's ``BatchStream`` seeks it through :meth:`load_state_dict`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["IterSource", "StreamSource", "StreamingDataset"]


class StreamSource(Protocol):
    """A source of raw samples with a known count, read sequentially from any position."""

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> Iterator[Any]:
        """Raw samples ``start`` to ``stop - 1``, in order."""
        ...


class IterSource:
    """A :class:`StreamSource` over samples that can only be read from the first: a file's
    records, a streamed hub split. ``open()`` (picklable, e.g. a ``functools.partial``, as
    loader workers call it) starts a fresh read; ``read`` skips to ``start`` (the skipped
    samples are parsed, never transformed). Without ``count``, one pass counts them.
    """

    def __init__(self, open: Callable[[], Iterable[Any]], count: int | None = None) -> None:
        self.open = open
        self.count = count if count is not None else sum(1 for _ in open())

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, stop: int) -> Iterator[Any]:
        return islice(self.open(), start, stop)


class StreamingDataset(IterableDataset):
    """Samples of ``sources`` read lazily, ``transform`` applied to each raw sample.

    Args:
        sources: the shards, each a :class:`StreamSource`.
        transform: raw sample -> item (decode, augment); runs in the loader worker.
        buffer_size: samples per shuffle block (memory: one block of raw samples per worker).

    The loader (:func:`tk.core.data.build_loader`) binds it to a rank, batch size, seed and
    shuffling with :meth:`bind`; ``set_epoch``, ``state_dict`` and ``load_state_dict`` then
    work as for the resumable samplers (position counted in batches).
    """

    def __init__(self, sources: Sequence[StreamSource], transform: Callable[[Any], Any] | None = None,
                 buffer_size: int = 1000) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        self.sources, self.transform, self.buffer_size = list(sources), transform, buffer_size
        self.lengths = [len(s) for s in self.sources]
        self.batch_size, self.shuffle, self.drop_last, self.seed = 1, False, False, 0
        self.rank, self.world_size = 0, 1
        self.epoch, self.start = 0, 0

    def bind(self, *, batch_size: int, shuffle: bool, drop_last: bool, seed: int, rank: int, world_size: int) -> None:
        """Read for this process: its rank's share, in batches of ``batch_size``."""
        self.batch_size, self.shuffle, self.drop_last, self.seed = batch_size, shuffle, drop_last, seed
        self.rank, self.world_size = rank, world_size

    # -- position (as tk.core.data.loader's samplers) -----------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.start = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.start = int(state.get("epoch", self.epoch)), int(state["batch"])

    # -- the order of a pass ------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self.lengths)

    def _rank_range(self) -> tuple[int, int]:
        """(first sample, samples) of this rank in the pass's sequence."""
        if self.drop_last or self.shuffle:
            share = self.total // self.world_size
            return self.rank * share, share
        base, extra = divmod(self.total, self.world_size)  # evaluation: every sample, ranks differ by <= 1
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)

    def __len__(self) -> int:
        """Samples this rank yields per pass (whole batches when dropping the last)."""
        n = self._rank_range()[1]
        return n - n % self.batch_size if self.drop_last else n

    def _generator(self, *keys: int) -> torch.Generator:
        state = np.random.SeedSequence([k % 2**64 for k in (self.seed, self.epoch, *keys)]).generate_state(1)
        return torch.Generator().manual_seed(int(state[0]))

    def _source_order(self) -> list[int]:
        n = len(self.sources)
        return torch.randperm(n, generator=self._generator(2**32)).tolist() if self.shuffle else list(range(n))

    def _read(self, order: list[int], start: int, stop: int) -> Iterator[Any]:  # one sequential read
        """Raw samples ``start .. stop - 1`` of the pass's sequence (sources in ``order``)."""
        ends = [0]
        for i in order:
            ends.append(ends[-1] + self.lengths[i])
        k = bisect.bisect_right(ends, start) - 1
        while start < stop:
            a, b = start - ends[k], min(stop, ends[k + 1]) - ends[k]
            yield from self.sources[order[k]].read(a, b)
            start, k = ends[k] + b, k + 1

    def _batch_sizes(self, count: int) -> list[int]:
        whole, rest = divmod(count, self.batch_size)
        return [self.batch_size] * whole + ([rest] if rest and not self.drop_last else [])

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        first, count = self._rank_range()
        sizes = self._batch_sizes(count)
        lane = (self.start + worker) % workers  # DataLoader asks worker 0 first: it serves batch `start`
        offset = sum(sizes[i] for i in range(len(sizes)) if i % workers < lane)  # lanes are contiguous
        mine = sizes[lane::workers]
        skip = len(range(lane, self.start, workers))  # this lane's batches before the position
        begin, end = sum(mine[:skip]), sum(mine)
        order = self._source_order()
        block = begin // self.buffer_size * self.buffer_size
        raw_samples = self._read(order, first + offset + block, first + offset + end)
        for block in range(block, end, self.buffer_size):
            raw = list(islice(raw_samples, min(self.buffer_size, end - block)))
            perm = (torch.randperm(len(raw), generator=self._generator(self.rank, workers, lane, block)).tolist()
                    if self.shuffle else range(len(raw)))
            for j in range(max(block, begin) - block, len(raw)):
                sample = raw[perm[j]]
                yield self.transform(sample) if self.transform is not None else sample
        self.start = 0  # a finished pass: the next one starts from its beginning
