"""What a ``Trainer`` checkpoint holds, and restoring a trainer from one.

Resume is exact: a checkpoint holds the model, optimiser, scheduler, loss scaler, EMA,
the data position, the progress counters, the best metric and every process's RNG
states, captured after the update, so a resumed run draws the same batches and random
numbers as an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tk.core.config import RunConfig, TrainConfig, config_diff
from tk.core.errors import TkError
from tk.core.run.checkpoint import load_resumed_model
from tk.core.run.rng import gather_rng_states, restore_rng_state
from tk.core.run.runlog import RunLog
from tk.core.run.shards import SHARDS_KEY, load_shards, sharded_training_state
from tk.core.task import Task
from tk.core.training.batches import BatchStream, FixedBatches
from tk.core.training.best import BestTracker
from tk.core.training.ema import ModelEMA
from tk.core.training.parallel import is_fsdp, load_full_training_state
from tk.core.training.precision import Precision
from tk.core.training.progress import RunProgress

__all__ = ["Resumable", "trainer_state", "load_trainer_state"]


class Resumable(Protocol):
    """The parts of a :class:`~tk.core.engine.train.Trainer` that a checkpoint holds or
    restores (named here, not imported, so this module does not import the loop)."""

    cfg: RunConfig
    tcfg: TrainConfig
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LRScheduler
    precision: Precision
    ema: ModelEMA | None
    batches: BatchStream | FixedBatches
    counts: RunProgress
    best: BestTracker
    log: RunLog
    step: int
    rank: int
    world_size: int

    @property
    def progress(self) -> dict[str, Any]: ...


def trainer_state(trainer: Resumable) -> dict[str, Any]:
    """Everything a resume needs. Collective when distributed: call on every process.

    A sharded (fsdp) model's weights and optimiser state are this process's shards under
    ``"shards"`` (:func:`~tk.core.run.shards.save_shards` writes them), not ``"model"``
    and ``"optimizer"``."""
    t = trainer
    rng = gather_rng_states(t.world_size)
    weights = {"shards": sharded_training_state(t.model, t.optimizer)} if is_fsdp(t.model) else \
        {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict()}
    return {
        **weights, "strategy": t.tcfg.strategy,
        "scheduler": t.scheduler.state_dict(), "precision": t.precision.state_dict(),
        "ema": t.ema.state_dict() if t.ema is not None else None,
        "step": t.step, "data": t.batches.state_dict(), "progress": t.progress,
        "rng": rng, "world_size": t.world_size,
        "config": t.cfg.to_dict(), "task": t.cfg.task, "task_state": t.task.state_dict(),
    }


def load_trainer_state(trainer: Resumable, state: dict[str, Any]) -> None:
    """Restore :func:`trainer_state` (all but the task state, which the assembly restored
    before set-up).

    Raises:
        TkError: the checkpoint holds another model (naming the mismatching weights and
            the config settings that differ).
    """
    t = trainer
    saved = state.get("strategy", "ddp")
    if (saved == "fsdp") != is_fsdp(t.model):  # the optimiser states differ: keyed by name vs by index
        raise TkError(f"--resume: the checkpoint was written with train.strategy={saved} but this run uses "
                      f"train.strategy={t.tcfg.strategy}; resume with train.strategy={saved}")
    if is_fsdp(t.model):
        diff = config_diff(state.get("config", {}), t.cfg.to_dict())
        try:
            if SHARDS_KEY in state:  # DCP shards, re-sharded to this run's processes
                load_shards(Path(state[SHARDS_KEY]), t.model, t.optimizer)
            else:  # full state dicts (FSDP checkpoints before sharded ones)
                load_full_training_state(t.model, t.optimizer, state["model"], state["optimizer"])
        except TkError as e:
            raise TkError(f"--resume: {e}. Settings that differ from the checkpoint's run: "
                          f"{'; '.join(diff) or 'none'}") from None
        except (RuntimeError, KeyError, ValueError) as e:  # another model: a one-line error, as for ddp
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TkError(f"--resume: the checkpoint does not fit this model ({first}). Settings that differ "
                          f"from the checkpoint's run: {'; '.join(diff) or 'none'}") from None
    else:
        diff = load_resumed_model(t.model, state, t.cfg.to_dict())
        t.optimizer.load_state_dict(state["optimizer"])
    if diff:
        t.log.echo("resuming with changed settings: " + "; ".join(diff))
    t.scheduler.load_state_dict(state["scheduler"])
    t.precision.load_state_dict(state["precision"])
    if t.ema is not None:
        if state.get("ema") is not None:
            t.ema.load_state_dict(state["ema"])
        else:  # EMA switched on at resume: start averaging from the loaded weights
            t.ema.module.load_state_dict(t.model.state_dict())
    t.step = state["step"]
    t.counts.load_state_dict(state["progress"])
    t.best.load_state_dict(state["progress"])
    t.batches.load_state_dict(state["data"])
    rng = state["rng"]
    if len(rng) != t.world_size:
        t.log.echo(f"note: the checkpoint comes from {len(rng)} process(es), this run has "
                   f"{t.world_size}; random numbers will not match an uninterrupted run, and the global batch "
                   f"(train.batch_size x train.grad_accum x processes) changes unless you scale train.batch_size")
    restore_rng_state(rng[t.rank % len(rng)])
