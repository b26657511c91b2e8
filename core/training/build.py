"""The trainer's parts that follow from the config: split loaders, the stream of training
batches, the frozen teacher, the DDP wrapper, and the check of ``train.best_metric``."""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tk.core.config import TrainConfig
from tk.core.data.loader import LoaderSpec
from tk.core.errors import TkError
from tk.core.run.rng import preserved_rng
from tk.core.step import EvalContext
from tk.core.task import Task
from tk.core.training.batches import BatchStream, FixedBatches, agreed_length, loader_length
from tk.core.training.evaluate import metric_keys

__all__ = ["split_loader", "run_loaders", "batch_stream", "prepare_teacher", "wrap_ddp", "check_best_metric"]


def split_loader(task: Task, split: str, t: TrainConfig, training: bool, rank: int, world_size: int,
                 device: torch.device) -> Any:
    """The task's loader of ``split`` for the engine (training: shuffled, drop last).

    Raises:
        TkError: the split yields no batches.
    """
    spec = LoaderSpec(
        batch_size=t.batch_size if training else (t.eval_batch_size or t.batch_size),
        shuffle=training, drop_last=training, seed=t.seed, num_workers=t.num_workers,
        rank=rank, world_size=world_size, pin_memory=device.type == "cuda",
    )
    with preserved_rng():  # building data never shifts the training random numbers
        loader = task.build_loader(split, spec)
    if loader_length(loader) == 0:
        size = loader_length(getattr(loader, "dataset", None)) or "?"
        raise TkError(f"the {split} split yields no batches ({size} samples, batch size "
                      f"{spec.batch_size} x {world_size} processes); add data or lower "
                      f"train.{'batch_size' if training else 'eval_batch_size'}")
    return loader


def run_loaders(task: Task, t: TrainConfig, rank: int, world_size: int, device: torch.device) -> tuple[Any, Any]:
    """The train and val loaders of a run, both built at set-up so that a missing or
    broken val split fails now, not after training."""
    return tuple(split_loader(task, split, t, split == "train", rank, world_size, device) for split in ("train", "val"))


def batch_stream(loader: Any, t: TrainConfig, rank: int, world_size: int,
                 echo=print) -> tuple[BatchStream | FixedBatches, int | None]:
    """The resumable stream of training micro-batches and the updates per pass (None for
    a loader without a length: then only ``train.max_steps`` ends the run).

    Raises:
        TkError: no ``train.max_steps`` for a loader without a length, or fewer batches
            than ``train.grad_accum``.
    """
    if t.overfit_batches:
        return FixedBatches(loader, t.overfit_batches), max(1, t.overfit_batches // t.grad_accum)
    fewest, most = agreed_length(loader, world_size)
    if fewest is None:  # no len(): an IterableDataset or an endless sampler (RandomIndexSampler)
        if t.max_steps is None:
            raise TkError("train.max_steps: the train loader has no length (an IterableDataset or a sampler "
                          "without __len__), so train.epochs cannot be counted; set train.max_steps (and "
                          "train.eval_every to evaluate before the end)")
        return BatchStream(loader, None, t.seed, rank, echo), None
    if fewest != most:  # DDP needs the same number of updates everywhere
        echo(f"note: the train loader yields {fewest} to {most} batches per process; every process "
             f"uses {fewest} per pass")
    steps = fewest // t.grad_accum
    if steps == 0:
        raise TkError(f"train.grad_accum ({t.grad_accum}) is larger than the {fewest} "
                      f"batches of one pass over the train split; lower train.grad_accum or train.batch_size")
    return BatchStream(loader, steps * t.grad_accum, t.seed, rank, echo), steps


def prepare_teacher(teacher: nn.Module | None, device: torch.device) -> nn.Module | None:
    """A task's teacher on ``device``, in eval mode, without gradients."""
    if teacher is None:
        return None
    teacher = teacher.to(device).eval()
    teacher.requires_grad_(False)
    return teacher


def wrap_ddp(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """``model`` in DistributedDataParallel when there are several processes."""
    if world_size == 1:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def check_best_metric(task: Task, key: str, with_ema: bool) -> None:
    """``train.best_metric`` must be a key that EVERY evaluation returns: checked against
    the metrics' declared keys before the first step, for a first, a later periodic and
    the final evaluation (a task may add costly metrics only on some, ``ctx.every(n)``).

    Raises:
        TkError: ``key`` is not among them (with a did-you-mean).
    """
    contexts = [EvalContext("val", kind="periodic"), EvalContext("val", kind="periodic", index=1),
                EvalContext("val", kind="final", index=1)]
    per_eval = []
    for ctx in contexts:
        keys = metric_keys(task, ctx)
        if with_ema:
            keys += metric_keys(task, EvalContext("val", ctx.step, ctx.kind, ctx.index, prefix="val_ema"))
        per_eval.append(keys)
    check_keys(key, [k for k in per_eval[0] if all(k in other for other in per_eval[1:])])


def check_keys(key: str, keys: list[str]) -> None:
    """``train.best_metric`` ``key`` among ``keys``.

    Raises:
        TkError: it is not, with a did-you-mean.
    """
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TkError(f"train.best_metric: {key!r} is not an evaluation result{hint} (results: {', '.join(keys)})")
