"""What a ``Trainer`` checkpoint holds, and restoring a trainer from one.

Resume is exact: a checkpoint holds the model, optimiser, scheduler, loss scaler, EMA,
the data position, the progress counters, the best metric and every process's RNG
states, captured after the update, so a resumed run draws the same batches and random
numbers as an uninterrupted one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tk.core.engine.checkpoint import gather_rng_states, load_resumed_model, restore_rng_state

if TYPE_CHECKING:
    from tk.core.engine.train import Trainer

__all__ = ["trainer_state", "load_trainer_state"]


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Everything a resume needs. Collective when distributed: call on every process."""
    t = trainer
    rng = gather_rng_states(t.world_size)
    return {
        "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(), "precision": t.precision.state_dict(),
        "ema": t.ema.state_dict() if t.ema is not None else None,
        "step": t.step, "data": t.batches.state_dict(), "progress": t.progress,
        "rng": rng, "world_size": t.world_size,
        "config": t.cfg.to_dict(), "task": t.cfg.task, "task_state": t.task.state_dict(),
    }


def load_trainer_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Restore :func:`trainer_state` (all but the task state, which the assembly restored
    before set-up).

    Raises:
        TkError: the checkpoint holds another model (naming the mismatching weights and
            the config settings that differ).
    """
    t = trainer
    diff = load_resumed_model(t.model, state, t.cfg.to_dict())
    if diff:
        t.log.echo("resuming with changed settings: " + "; ".join(diff))
    t.optimizer.load_state_dict(state["optimizer"])
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
                   f"{t.world_size}; random numbers will not match an uninterrupted run")
    restore_rng_state(rng[t.rank % len(rng)])
