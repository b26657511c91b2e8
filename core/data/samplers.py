"""Batch samplers for text: token-budget batches, and endless random batches for
iteration-based training.

Both are *resumable*: their batches are a pure function of a seed and a position (epoch
and batch number), and ``load_state_dict`` moves them to a position without producing
the batches before it, so the engine resumes without loading consumed data (see
``tk.core.training.batches.BatchStream``). The protocol, shared with the item samplers of
``tk.core.data.loader``: attributes ``epoch`` and ``start`` (batches skipped at the
beginning of the next pass), ``set_epoch(epoch)`` (a fresh pass) and
``state_dict()`` / ``load_state_dict({"epoch": e, "batch": k})``.

Token budgets follow fairseq's ``batch_by_size`` (Ott et al., 2019,
https://arxiv.org/abs/1904.01038); random blocks follow nanoGPT's ``get_batch``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from tk.core.data.loader import LoaderSpec
from tk.core.errors import TkError

__all__ = ["RandomBlockSampler", "RandomIndexSampler", "TokenBudgetBatchSampler"]


def _rng(*keys: int) -> np.random.Generator:
    """A generator seeded by ``keys`` alone (negative seeds wrap: SeedSequence takes none)."""
    return np.random.default_rng([k % 2**64 for k in keys])


def _check_shard(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size) with world_size ({world_size}) >= 1")


def _greedy_bounds(lengths: list[int], buckets: list[int], max_tokens: int,
                   max_batch_size: int | None) -> list[tuple[int, int]]:
    """Cut ascending ``lengths`` into [start, end) batches whose size x longest fits
    ``max_tokens`` and that never span two buckets (fairseq's ``batch_by_size``)."""
    bounds, start = [], 0
    for i, n in enumerate(lengths):
        size = i - start + 1
        full = size * n > max_tokens or (max_batch_size is not None and size > max_batch_size)
        if i > start and (full or buckets[i] != buckets[start]):
            bounds.append((start, i))
            start = i
    if lengths:
        bounds.append((start, len(lengths)))
    return bounds


def _split_to_multiple(bounds: list[tuple[int, int]], world_size: int) -> tuple[list[tuple[int, int]], int]:
    """Halve the largest batches until their count is a multiple of ``world_size``.

    Returns the new bounds and how many batches must still be repeated (only when
    there are too few examples to split further)."""
    bounds = list(bounds)
    while len(bounds) % world_size:
        i = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
        start, end = bounds[i]
        if end - start < 2:
            return bounds, -len(bounds) % world_size
        mid = (start + end) // 2  # both halves keep the sorted order, so neither exceeds the budget
        bounds[i:i + 1] = [(start, mid), (mid, end)]
    return bounds, 0


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of similar-length examples whose padded size (batch x longest) stays within
    ``max_tokens``, sharded so that every process gets the same number of batches.

    One pass (epoch) is built in four steps:

    1. examples are sorted by length, ties in a random order seeded by (seed, epoch);
       with ``bucket_width`` w, lengths in [0, w), [w, 2w), ... never share a batch;
    2. batches are filled greedily in that order while ``len(batch) x longest <= max_tokens``
       and ``len(batch) <= max_batch_size`` (fairseq's ``batch_by_size``);
    3. for equal counts per process, the largest batches are halved until the count is a
       multiple of ``world_size``: every example still appears exactly once per pass.
       Only a dataset too small to split further (fewer examples than batches needed)
       repeats the first batches of the pass; ``num_repeated`` says how many (0 otherwise);
    4. the batch order is shuffled by (seed, epoch) (``shuffle=False``: shortest first),
       and rank r takes batches r, r + W, r + 2W, ... of it.

    The batch sizes depend on the sorted lengths only, so every pass has the same
    ``len`` on every process: DDP never waits on a process that ran out of batches.

    Args:
        lengths: tokens per example, shape (N,); for pairs (source, target) pass
            shape (N, 2): the longer side counts.
        max_tokens: padded tokens per batch (batch x longest example in it).
        bucket_width: optional length bucket width (see step 1); None = one bucket.
        max_batch_size: optional cap on examples per batch.
        shuffle: shuffle tie order and batch order by (seed, epoch) (training).
        seed: base seed; rank, world_size: this process and the number of processes.
        skip_too_long: leave out examples longer than ``max_tokens`` (their indices are
            in ``skipped``) instead of raising.

    Raises:
        TkError: an example is longer than ``max_tokens`` (and ``skip_too_long`` is off).
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int, *, bucket_width: int | None = None,
                 max_batch_size: int | None = None, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, skip_too_long: bool = False) -> None:
        _check_shard(rank, world_size)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if bucket_width is not None and bucket_width < 1:
            raise ValueError(f"bucket_width must be >= 1 (or None), got {bucket_width}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 (or None), got {max_batch_size}")
        sizes = np.asarray(lengths, dtype=np.int64)
        sizes = sizes.max(axis=1) if sizes.ndim == 2 else sizes.reshape(-1)
        too_long = np.flatnonzero(sizes > max_tokens)
        if len(too_long) and not skip_too_long:
            i = int(too_long[0])
            raise TkError(f"example {i} has {int(sizes[i])} tokens, more than max_tokens={max_tokens} "
                          f"({len(too_long)} such examples); raise max_tokens or leave them out "
                          f"(skip_too_long=True, or filter the dataset)")
        self.skipped: list[int] = too_long.tolist()
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.start = 0  # batches of this process skipped at the start of the next pass
        self._served = 0
        self._kept = np.setdiff1d(np.arange(len(sizes)), too_long)  # ascending example indices
        self._sizes = np.maximum(sizes[self._kept], 1)  # an empty example still takes a row
        ascending = self._sizes[np.argsort(self._sizes, kind="stable")]
        buckets = ascending // bucket_width if bucket_width else np.zeros_like(ascending)
        bounds = _greedy_bounds(ascending.tolist(), buckets.tolist(), max_tokens, max_batch_size)
        self._bounds, self.num_repeated = _split_to_multiple(bounds, world_size)

    @classmethod
    def from_spec(cls, spec: LoaderSpec, lengths: Sequence[int] | np.ndarray, max_tokens: int,
                  **options: Any) -> TokenBudgetBatchSampler:
        """The sampler for a :class:`LoaderSpec` (shuffle, seed, rank, world size from it;
        ``spec.batch_size`` is not used: ``max_tokens`` sets the batch size)."""
        return cls(lengths, max_tokens, shuffle=spec.shuffle, seed=spec.seed, rank=spec.rank,
                   world_size=spec.world_size, **options)

    def __len__(self) -> int:
        return (len(self._bounds) + self.num_repeated) // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Start a fresh pass ``epoch`` (the seed of its order)."""
        self.epoch, self.start = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """The position: ``epoch`` and ``batch``, batches of this process handed out in it
        (a DataLoader with workers fetches ahead, so the engine records its own count)."""
        return {"epoch": self.epoch, "batch": self._served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Move to ``state``: the next pass is ``state["epoch"]``, starting after its first
        ``state["batch"]`` batches (which are never produced)."""
        self.epoch = int(state.get("epoch", self.epoch))
        self.start = self._served = int(state["batch"])

    def pass_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches of pass ``epoch`` (default: the current one) for every process, in
        order; this process gets items ``rank::world_size`` of it."""
        rng = _rng(self.seed, self.epoch if epoch is None else epoch)
        if self.shuffle:
            order = np.lexsort((rng.permutation(len(self._sizes)), self._sizes))  # by length, random ties
        else:
            order = np.argsort(self._sizes, kind="stable")
        examples = self._kept[order]
        batches = [examples[s:e].tolist() for s, e in self._bounds]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches + batches[:self.num_repeated]

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.pass_batches()[self.rank::self.world_size]
        self._served = self.start
        for batch in mine[self.start:]:
            self._served += 1
            yield batch
        self.start = 0  # a finished pass: the next one starts from its beginning


class RandomIndexSampler(Sampler[list[int]]):
    """Endless random batches for iteration-based training (no epochs).

    Batch number k (0, 1, 2, ...; a micro-batch, so the step when ``train.grad_accum=1``)
    of the whole job holds ``batch_size * world_size`` indices drawn uniformly, with
    replacement, from [0, num_items) by a generator seeded with (seed, k) alone, and process
    ``rank`` takes its ``batch_size`` of them: a pure function, so a resumed run continues at
    batch k without drawing the ones before it, and N processes with batches of B see
    exactly the batches of one process with batches of N x B (the same updates). It has no
    ``__len__``: train with ``train.max_steps`` (and ``train.eval_every`` to evaluate before
    the end).

    Args:
        num_items: dataset size.
        batch_size: indices per batch on this process.
        seed: base seed; rank, world_size: this process and the number of processes.
    """

    def __init__(self, num_items: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        if num_items < 1 or batch_size < 1:
            raise ValueError(f"num_items ({num_items}) and batch_size ({batch_size}) must be >= 1")
        _check_shard(rank, world_size)
        self.num_items, self.batch_size, self.seed, self.rank = num_items, batch_size, seed, rank
        self.world_size = world_size
        self.epoch = 0  # no epochs; kept for the worker seeding of tk.core.data.loader
        self.start = 0  # the batch number the next iteration starts at
        self._served = 0

    @classmethod
    def from_spec(cls, spec: LoaderSpec, num_items: int) -> RandomIndexSampler:
        """The sampler for a :class:`LoaderSpec` (batch size, seed, rank and world size from it)."""
        return cls(num_items, spec.batch_size, seed=spec.seed, rank=spec.rank, world_size=spec.world_size)

    def batch(self, k: int) -> list[int]:
        """Batch number ``k`` of this process: its slice of the job's batch ``k``."""
        # the key (seed, 0, k) keeps one process's stream what it was when every rank drew its own
        rng = _rng(self.seed, 0, k)
        drawn = rng.integers(0, self.num_items, self.batch_size * self.world_size)
        return drawn[self.rank * self.batch_size:(self.rank + 1) * self.batch_size].tolist()

    def state_dict(self) -> dict[str, int]:
        """``{"batch": k}``: batches handed out (the next one is number k)."""
        return {"batch": self._served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at batch ``state["batch"]`` (other keys, such as ``epoch``, are ignored)."""
        self.start = self._served = int(state["batch"])

    def __iter__(self) -> Iterator[list[int]]:
        k = self.start
        while True:
            self._served = k + 1
            yield self.batch(k)
            k += 1


class RandomBlockSampler(RandomIndexSampler):
    """Random block start offsets over a token stream (nanoGPT's ``get_batch``), as a pure
    function of (seed, batch number, rank, world size); see :class:`RandomIndexSampler`.

    Offsets lie in [0, num_tokens - block_size], so ``tokens[o : o + block_size]`` always
    fits; a language model that needs inputs and shifted targets passes
    ``block_size + 1``. The dataset's item ``o`` is the block starting at token ``o``.

    Args:
        num_tokens: length N of the token array.
        block_size: tokens per block.
        batch_size: blocks per batch.
        seed: base seed; rank, world_size: this process and the number of processes.
    """

    def __init__(self, num_tokens: int, block_size: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        if not 1 <= block_size <= num_tokens:
            raise ValueError(f"block_size ({block_size}) must be in [1, num_tokens ({num_tokens})]")
        super().__init__(num_tokens - block_size + 1, batch_size, seed=seed, rank=rank, world_size=world_size)
        self.num_tokens, self.block_size = num_tokens, block_size

    @classmethod
    def from_spec(  # type: ignore[override]
            cls, spec: LoaderSpec, num_tokens: int, block_size: int) -> RandomBlockSampler:
        """The sampler for a :class:`LoaderSpec` (batch size, seed, rank and world size from it)."""
        return cls(num_tokens, block_size, spec.batch_size, seed=spec.seed, rank=spec.rank,
                   world_size=spec.world_size)
