"""Data loading shared by every task: the loader spec, resumable samplers and the default
loader (``loader``), and batch samplers for text (``samplers``: token budgets, endless
random batches for iteration-based training)."""

from tk.core.data.loader import (
    DistributedEpochSampler,
    EpochSeededRandomSampler,
    LoaderSpec,
    ShardSampler,
    WorkerSeeding,
    build_loader,
    build_sampler,
)
from tk.core.data.samplers import RandomBlockSampler, RandomIndexSampler, TokenBudgetBatchSampler

__all__ = [
    "DistributedEpochSampler", "EpochSeededRandomSampler", "LoaderSpec", "RandomBlockSampler",
    "RandomIndexSampler", "ShardSampler", "TokenBudgetBatchSampler", "WorkerSeeding", "build_loader",
    "build_sampler",
]
