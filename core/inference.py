"""Rebuild a trained run (task + model) from its run directory, for eval and predict."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tk.core.errors import TkError
from tk.core.task import Task


def resolve_checkpoint(run_dir: Path, checkpoint: str) -> Path:
    """``best`` | ``last`` | a path -> an existing checkpoint file."""
    if checkpoint in ("best", "last"):
        path = run_dir / "checkpoints" / f"{checkpoint}.pt"
        if checkpoint == "best" and not path.exists():
            path = run_dir / "checkpoints" / "last.pt"
    else:
        path = Path(checkpoint)
    if not path.is_file():
        raise TkError(f"checkpoint not found: {path}; train first with `tk run`, or pass --checkpoint PATH")
    return path


def load_run(run_dir: str | Path, checkpoint: str = "best", overrides: list[str] = ()) -> tuple[Task, nn.Module]:
    """The task and model of a finished (or interrupted) run, model in eval mode.

    Args:
        run_dir: a directory written by ``tk run`` (holds ``config.yaml``, ``checkpoints/``).
        checkpoint: ``best``, ``last`` or a checkpoint file.
        overrides: ``key.sub=value`` applied to the run's saved config.

    Raises:
        TkError: not a run dir, missing checkpoint, or a checkpoint of another model.
    """
    from tk.core.checkpoint import load_checkpoint, load_model_state
    from tk.core.config import load_config

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise TkError(f"{run_dir} is not a tk run dir (no config.yaml); pass the output_dir of a `tk run`")
    cfg, task_cls = load_config(str(config_path), list(overrides))
    state = load_checkpoint(resolve_checkpoint(run_dir, checkpoint))
    task = task_cls(cfg)
    task.load_state_dict(state.get("task_state", {}))
    model = task.build_model()
    load_model_state(model, state["model"])
    return task, model.eval()
