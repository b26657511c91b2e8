"""Rebuild a trained run (task + model) from its run directory, for eval and predict."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from safetensors.torch import load_file
from torch import nn

from tk.core.data.loader import LoaderSpec
from tk.core.engine.assemble import assemble
from tk.core.engine.checkpoint import load_checkpoint, load_model_state
from tk.core.engine.device import resolve_device
from tk.core.engine.evaluate import evaluate_loader
from tk.core.engine.precision import Precision
from tk.core.errors import TkError
from tk.core.recipe import load_config
from tk.core.step import EvalContext
from tk.core.task import Task

__all__ = ["resolve_checkpoint", "step_checkpoints", "load_run", "evaluate_run"]

_STEP_RE = re.compile(r"^step_(\d+)\.pt$")


def resolve_checkpoint(run_dir: Path, checkpoint: str) -> Path:
    """``best`` | ``last`` | a path -> an existing checkpoint file. A relative path is
    looked up from the working directory, then in the run dir and its ``checkpoints/``."""
    if checkpoint in ("best", "last"):
        path = run_dir / "checkpoints" / f"{checkpoint}.pt"
        if checkpoint == "best" and not path.exists():
            path = run_dir / "checkpoints" / "last.pt"
    else:
        given = Path(checkpoint).expanduser()
        candidates = [given] if given.is_absolute() else [given, run_dir / given, run_dir / "checkpoints" / given]
        path = next((p for p in candidates if p.is_file()), given)
    if not path.is_file():
        raise TkError(f"checkpoint not found: {path}; train first with `tk run`, or pass --checkpoint PATH")
    return path


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's ``checkpoints/step_*.pt`` files as (step, path), oldest first.

    Raises:
        TkError: ``run_dir`` has no ``checkpoints`` folder.
    """
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        raise TkError(f"{run_dir} has no checkpoints/ folder; pass the output_dir of a `tk run`")
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_RE.match(p.name))]
    return sorted(found)


@dataclass
class _SavedRun:
    """A run dir's config, checkpoint state and the weights to load."""

    cfg: Any
    task_cls: type[Task]
    source: Path  # the checkpoint or weights file
    state: dict[str, Any]  # the checkpoint (task state, step, ...); {} for bare weights without checkpoints
    weights: Mapping[str, Any]


def _open_run(run_dir: Path, checkpoint: str, overrides: list[str], ema: bool, weights: str | None) -> _SavedRun:
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise TkError(f"{run_dir} is not a tk run dir (no config.yaml); pass the output_dir of a `tk run`")
    cfg, task_cls = load_config(str(config_path), list(overrides))
    if weights is not None:  # bare weights + the run's config; task state from its newest checkpoint
        source = Path(weights).expanduser()
        if not source.is_file():
            raise TkError(f"--weights: no file {source}; pass a .safetensors file (e.g. the run's model.safetensors)")
        last = run_dir / "checkpoints" / "last.pt"
        return _SavedRun(cfg, task_cls, source, load_checkpoint(last) if last.is_file() else {}, load_file(source))
    source = resolve_checkpoint(run_dir, checkpoint)
    state = load_checkpoint(source)
    if ema and state.get("ema") is None:
        raise TkError(f"--ema: {source} holds no EMA weights; the run was trained without train.ema_decay")
    return _SavedRun(cfg, task_cls, source, state, state["ema"]["module"] if ema else state["model"])


def _assemble_saved(run_dir: Path, saved: _SavedRun, mode: str, build_data=None) -> tuple[Task, nn.Module, Any]:
    built = assemble(saved.cfg, saved.task_cls, run_dir, mode, state=saved.state, build_data=build_data)
    load_model_state(built.model, saved.weights)
    return built.task, built.model.eval(), built.data


def load_run(run_dir: str | Path, checkpoint: str = "best", overrides: list[str] = (),
             ema: bool = False, weights: str | None = None) -> tuple[Task, nn.Module]:
    """The task and model of a finished (or interrupted) run, model in eval mode, built
    in the documented order (``tk.core.engine.assemble``, mode "predict").

    Args:
        run_dir: a directory written by ``tk run`` (holds ``config.yaml``, ``checkpoints/``),
            wherever it is now: the task gets this path, not the saved ``output_dir``.
        checkpoint: ``best``, ``last`` or a checkpoint file (e.g. from ``tk average``).
        overrides: ``key.sub=value`` applied to the run's saved config.
        ema: load the EMA weights instead of the raw ones.
        weights: a bare ``.safetensors`` file to load instead of a checkpoint's weights.

    Raises:
        TkError: not a run dir, missing checkpoint, or a checkpoint of another model.
    """
    run_dir = Path(run_dir)
    task, model, _ = _assemble_saved(run_dir, _open_run(run_dir, checkpoint, list(overrides), ema, weights), "predict")
    return task, model


def evaluate_run(run_dir: str | Path, checkpoint: str = "best", split: str = "val",
                 overrides: list[str] = (), ema: bool = False, weights: str | None = None) -> dict[str, Any]:
    """``tk eval``: the task's loss and metrics of a run's checkpoint on ``split``.

    The device, precision and eval batch size come from the run's ``train:`` section
    (override them, e.g. ``train.device=cpu``).

    Returns:
        ``{"run_dir", "checkpoint", "step", "split", "ema", "metrics": {"val/loss": ...}}``.

    Raises:
        TkError: see :func:`load_run`; or the split has no data.
    """
    run_dir = Path(run_dir)
    saved = _open_run(run_dir, checkpoint, list(overrides), ema, weights)
    t = saved.cfg.train
    device = resolve_device(t.device)
    precision = Precision(t.precision, device)
    spec = LoaderSpec(batch_size=t.eval_batch_size or t.batch_size, num_workers=t.num_workers, seed=t.seed,
                      pin_memory=device.type == "cuda")
    task, model, loader = _assemble_saved(run_dir, saved, "eval", lambda task: task.build_loader(split, spec))
    if len(loader) == 0:
        raise TkError(f"the {split} split yields no batches; check the task's data settings")
    step = saved.state.get("step") or 0
    ctx = EvalContext(split, step, "standalone")
    metrics = evaluate_loader(task, model.to(device), loader, device, precision, ctx, run_dir / "eval")
    return {"run_dir": str(run_dir), "checkpoint": str(saved.source), "step": saved.state.get("step"),
            "split": split, "ema": ema, "metrics": metrics}
