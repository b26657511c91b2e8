"""Rebuild a trained run (task + model) from its run directory, for eval and predict."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from torch import nn

from tk.core.data.loader import LoaderSpec
from tk.core.engine.checkpoint import load_checkpoint, load_model_state
from tk.core.engine.device import resolve_device
from tk.core.engine.evaluate import evaluate_loader
from tk.core.engine.precision import Precision
from tk.core.engine.predict import predict_batches
from tk.core.errors import TkError
from tk.core.recipe import load_config
from tk.core.task import Task

__all__ = ["evaluate_run", "load_run", "predict_run", "resolve_checkpoint", "step_checkpoints"]

_STEP_RE = re.compile(r"^step_(\d+)\.pt$")


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


def _load(run_dir: str | Path, checkpoint: str, overrides: list[str]):
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise TkError(f"{run_dir} is not a tk run dir (no config.yaml); pass the output_dir of a `tk run`")
    cfg, task_cls = load_config(str(config_path), list(overrides))
    path = resolve_checkpoint(run_dir, checkpoint)
    return cfg, task_cls, path, load_checkpoint(path)


def _build(cfg, task_cls, state: dict[str, Any], ema: bool, path: Path) -> tuple[Task, nn.Module]:
    task = task_cls(cfg)
    task.load_state_dict(state.get("task_state", {}))
    model = task.build_model()
    if ema and state.get("ema") is None:
        raise TkError(f"--ema: {path} holds no EMA weights; the run was trained without train.ema_decay")
    load_model_state(model, state["ema"]["module"] if ema else state["model"])
    return task, model.eval()


def load_run(run_dir: str | Path, checkpoint: str = "best", overrides: list[str] = (),
             ema: bool = False) -> tuple[Task, nn.Module]:
    """The task and model of a finished (or interrupted) run, model in eval mode.

    Args:
        run_dir: a directory written by ``tk run`` (holds ``config.yaml``, ``checkpoints/``).
        checkpoint: ``best``, ``last`` or a checkpoint file.
        overrides: ``key.sub=value`` applied to the run's saved config.
        ema: load the EMA weights instead of the raw ones.

    Raises:
        TkError: not a run dir, missing checkpoint, or a checkpoint of another model.
    """
    cfg, task_cls, path, state = _load(run_dir, checkpoint, overrides)
    return _build(cfg, task_cls, state, ema, path)


def evaluate_run(run_dir: str | Path, checkpoint: str = "best", split: str = "val",
                 overrides: list[str] = (), ema: bool = False) -> dict[str, Any]:
    """``tk eval``: the task's loss and metrics of a run's checkpoint on ``split``.

    The device, precision and eval batch size come from the run's ``train:`` section
    (override them, e.g. ``train.device=cpu``).

    Returns:
        ``{"run_dir", "checkpoint", "step", "split", "ema", "metrics": {"val/loss": ...}}``.

    Raises:
        TkError: see :func:`load_run`; or the split has no data.
    """
    cfg, task_cls, path, state = _load(run_dir, checkpoint, overrides)
    device = resolve_device(cfg.train.device)
    precision = Precision(cfg.train.precision, device)
    task, model = _build(cfg, task_cls, state, ema, path)
    model.to(device)
    t = cfg.train
    loader = task.build_loader(split, LoaderSpec(batch_size=t.eval_batch_size or t.batch_size,
                                                 num_workers=t.num_workers, seed=t.seed,
                                                 pin_memory=device.type == "cuda"))
    if len(loader) == 0:
        raise TkError(f"the {split} split yields no batches; check the task's data settings")
    metrics = evaluate_loader(task, model, loader, device, precision, split)
    return {"run_dir": str(run_dir), "checkpoint": str(path), "step": state.get("step"), "split": split,
            "ema": ema, "metrics": metrics}


def predict_run(run_dir: str | Path, inputs: Iterable[str], checkpoint: str = "best", overrides: list[str] = (),
                batch_size: int = 32, device: str | None = None) -> Iterator[dict[str, Any]]:
    """``tk predict``: the run's model on raw inputs, one record per input, batch by batch.

    The run is loaded (and its device checked) before the first input is read; prediction
    options are the task's config keys, set through ``overrides`` (e.g. ``predict.top_k=3``).

    Args:
        run_dir: a directory written by ``tk run``.
        inputs: raw inputs (image paths, sentences, prompts); may be a lazy iterator (stdin).
        checkpoint: ``best``, ``last`` or a checkpoint file.
        overrides: ``key.sub=value`` applied to the run's saved config.
        batch_size: inputs per ``Task.predict`` call.
        device: a device name overriding ``train.device`` (None: the run's own, e.g. ``auto``).

    Returns:
        An iterator of ``{"input": ..., **prediction}`` or ``{"input": ..., "error": "..."}``
        records, in input order (see :func:`tk.core.engine.predict.predict_batches`).

    Raises:
        TkError: see :func:`load_run`; the task has no ``predict``; or the device or
            precision is not available.
    """
    overrides = list(overrides) + ([f"train.device={device}"] if device else [])
    task, model = load_run(run_dir, checkpoint, overrides)
    if type(task).predict is Task.predict:
        raise TkError(f"task {task.name or type(task).__name__!r} does not support prediction "
                      f"(its Task class has no predict method); use `tk eval` for metrics")
    target = resolve_device(task.cfg.train.device)
    precision = Precision(task.cfg.train.precision, target)
    model.to(target).eval()
    return predict_batches(task, model, inputs, batch_size, precision.autocast)
