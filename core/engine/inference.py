"""Rebuild a trained run (task + model) from its run directory, for eval and predict; and the
plugins' way to start a new run from a finished one (re-exported from :mod:`tk.core.exchange.pretrained`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml
from torch import nn

from tk.core.artifacts import ARTIFACTS_DIR
from tk.core.data.loader import LoaderSpec
from tk.core.engine.predict import predict_batches
from tk.core.errors import TkError
from tk.core.exchange.export import average_checkpoints, export_safetensors, read_weights, tk_metadata
from tk.core.exchange.pretrained import (
    RECORD_FILE,
    TRANSFORMER_SHAPE_KEYS,
    SourceRun,
    adopt_shape,
    describe_shape,
    load_backbone,
    open_source,
    read_record,
    shape_conflicts,
    what_is,
    write_record,
)
from tk.core.nn.lora import has_lora, merge_lora
from tk.core.recipe import load_config
from tk.core.run.checkpoint import (
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from tk.core.run.outputs import WRITTEN_BY, check_merge, check_output
from tk.core.step import EvalContext
from tk.core.task import Task
from tk.core.training.assemble import assemble
from tk.core.training.batches import loader_length
from tk.core.training.device import resolve_device
from tk.core.training.evaluate import evaluate_loader
from tk.core.training.precision import Precision

__all__ = ["average_run", "evaluate_run", "load_run", "load_run_source", "predict_run", "resolve_checkpoint",
           "step_checkpoints",
           # a run as a pretrained source (tk.core.exchange.pretrained), for the plugins' setup/init_pretrained
           "RECORD_FILE", "TRANSFORMER_SHAPE_KEYS", "SourceRun", "adopt_shape", "describe_shape", "load_backbone", "open_source",
           "read_record", "shape_conflicts", "what_is", "write_record"]

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
    if path.is_file():
        return path
    if checkpoint in ("best", "last"):
        raise TkError(f"{run_dir} has no checkpoint yet (checkpoints/best.pt or last.pt): the run saved none; "
                      f"continue it with `tk run ... --resume`, or wait for its first checkpoint")
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) if (run_dir / "checkpoints").is_dir() else []
    raise TkError(f"--checkpoint {checkpoint}: no such file (looked in the working directory, {run_dir} and its "
                  f"checkpoints/); give best, last or one of {', '.join(saved[:6]) or 'its checkpoint files'}")


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's ``checkpoints/step_*.pt`` files as (step, path), oldest first.

    Raises:
        TkError: ``run_dir`` has no ``checkpoints`` folder.
    """
    folder = Path(run_dir) / "checkpoints"
    _exists(Path(run_dir))
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
    ema: bool = False  # the weights are the checkpoint's EMA weights


def _exists(run_dir: Path) -> None:
    if not run_dir.exists():
        raise TkError(f"{run_dir} does not exist; pass the output_dir of a `tk run` (`tk runs` lists the runs here)")


def _config(run_dir: Path, overrides: list[str]) -> tuple[Any, type[Task]]:
    config_path = run_dir / "config.yaml"
    _exists(run_dir)
    if run_dir.is_file():
        raise TkError(f"{run_dir} is a file, not a run dir; pass the output_dir of a `tk run` (a checkpoint goes "
                      f"to --checkpoint)")
    if not config_path.is_file():
        raise TkError(f"{run_dir} is not a tk run dir (no config.yaml); pass the output_dir of a `tk run`")
    if not _written_by_tk(config_path):
        raise TkError(f"{run_dir} is not a tk run dir: its config.yaml was not written by `tk run` (no task: and "
                      f"train: sections); pass the output_dir of a `tk run`")
    return load_config(str(config_path), list(overrides))


def _written_by_tk(path: Path) -> bool:
    """A run's config.yaml as tk writes it: a mapping with ``task`` and a ``train`` section."""
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return True  # unreadable: load_config names the problem
    return isinstance(loaded, dict) and isinstance(loaded.get("task"), str) and isinstance(loaded.get("train"), dict)


def selects_ema(cfg: Any) -> bool:
    """Whether the run chose its model by an EMA metric (``train.best_metric: val_ema/...``):
    then its model is the EMA weights, and eval/predict/export use them unless told ``--raw``."""
    return bool(cfg.train.best_metric and cfg.train.best_metric.startswith("val_ema/"))


def _open_run(run_dir: Path, checkpoint: str, overrides: list[str], ema: bool | None, weights: str | None) -> _SavedRun:
    cfg, task_cls = _config(run_dir, overrides)
    if weights is not None:  # bare weights + the run's config; task state from its newest checkpoint
        source = Path(weights).expanduser()
        if not source.is_file():
            raise TkError(f"--weights: no file {source}; pass a .safetensors file (e.g. the run's model.safetensors)")
        last = run_dir / "checkpoints" / "last.pt"
        return _SavedRun(cfg, task_cls, source, load_checkpoint(last, full_model=False) if last.is_file() else {},
                         read_weights(source, "--weights"))
    source = resolve_checkpoint(run_dir, checkpoint)
    state = load_checkpoint(source)
    if ema is None:  # the weights the run selected
        ema = selects_ema(cfg) and state.get("ema") is not None
    if ema and state.get("ema") is None:
        raise TkError(f"--ema: {source} holds no EMA weights; the run was trained without train.ema_decay")
    return _SavedRun(cfg, task_cls, source, state, state["ema"]["module"] if ema else state["model"], ema)


def _assemble_saved(run_dir: Path, saved: _SavedRun, mode: str, build_data=None) -> tuple[Task, nn.Module, Any]:
    built = assemble(saved.cfg, saved.task_cls, run_dir, mode, state=saved.state, build_data=build_data)
    if has_lora(built.model) and not any(k.endswith(".lora_A") for k in saved.weights):
        built.model = merge_lora(built.model)  # merged weights (a LoRA run's model.safetensors)
    load_model_state(built.model, saved.weights)
    return built.task, built.model.eval(), built.data


def load_run(run_dir: str | Path, checkpoint: str = "best", overrides: list[str] = (),
             ema: bool | None = None, weights: str | None = None,
             average_last: int | None = None) -> tuple[Task, nn.Module]:
    """The task and model of a finished (or interrupted) run, model in eval mode, built
    in the documented order (``tk.core.training.assemble``, mode "predict").

    Args:
        run_dir: a directory written by ``tk run`` (holds ``config.yaml``, ``checkpoints/``),
            wherever it is now: the task gets this path, not the saved ``output_dir``.
        checkpoint: ``best``, ``last`` or a checkpoint file (e.g. from ``tk average``).
        overrides: ``key.sub=value`` applied to the run's saved config.
        ema: True: the checkpoint's EMA weights; False: its raw weights; None: the ones the
            run selected (EMA when ``train.best_metric`` is a ``val_ema/`` metric).
        weights: a bare ``.safetensors`` file to load instead of a checkpoint's weights.
        average_last: load the average of the run's last K step checkpoints' weights instead.

    Raises:
        TkError: not a run dir, missing checkpoint, a checkpoint of another model, or fewer
            than ``average_last`` step checkpoints.
    """
    run_dir = Path(run_dir)
    if average_last is not None:  # step checkpoints are averaged by their raw weights
        if ema:
            raise TkError("--average-last averages the raw weights of step checkpoints; drop --ema")
        ema = False
    task, model, _ = _assemble_saved(run_dir, _open_run(run_dir, checkpoint, list(overrides), ema, weights), "predict")
    if average_last is not None:
        found = step_checkpoints(run_dir)
        if not 1 <= average_last <= len(found):
            raise TkError(f"--average-last {average_last}: {run_dir} has {len(found)} step checkpoints; "
                          f"pass 1..{len(found)} (keep more with train.keep_last)")
        load_model_state(model, average_checkpoints([p for _, p in found[-average_last:]]))
    return task, model


def load_run_source(run_dir: str | Path, checkpoint: str = "best", overrides: list[str] = (),
                    ema: bool | None = None) -> tuple[Task, nn.Module, dict[str, Any]]:
    """:func:`load_run` plus where the weights came from (for ``tk export``'s model card).

    Returns:
        ``(task, model, {"checkpoint": path, "step": int | None, "ema": bool})``.

    Raises:
        TkError: see :func:`load_run`.
    """
    run_dir = Path(run_dir)
    saved = _open_run(run_dir, checkpoint, list(overrides), ema, None)
    task, model, _ = _assemble_saved(run_dir, saved, "predict")
    return task, model, {"checkpoint": str(saved.source), "step": saved.state.get("step"), "ema": saved.ema}


def evaluate_run(run_dir: str | Path, checkpoint: str = "best", split: str = "val",
                 overrides: list[str] = (), ema: bool | None = None, weights: str | None = None) -> dict[str, Any]:
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
    if loader_length(loader) == 0:
        raise TkError(f"the {split} split yields no batches; check the task's data settings")
    step = saved.state.get("step") or 0
    ctx = EvalContext(split, step, "standalone")
    metrics = evaluate_loader(task, model.to(device), loader, device, precision, ctx, run_dir / "eval")
    return {"run_dir": str(run_dir), "checkpoint": str(saved.source), "step": saved.state.get("step"),
            "split": split, "ema": saved.ema, "metrics": metrics}


def predict_run(run_dir: str | Path, inputs: Iterable[str], checkpoint: str = "best", overrides: list[str] = (),
                batch_size: int = 32, device: str | None = None,
                weights: str | None = None, ema: bool | None = None) -> Iterator[dict[str, Any]]:
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
        weights: a bare ``.safetensors`` file to load instead of the checkpoint's weights.
        ema: the checkpoint's EMA (True) or raw (False) weights; None: the ones the run selected.

    Returns:
        An iterator of ``{"input": ..., **prediction}`` or ``{"input": ..., "error": "..."}``
        records, in input order (see :func:`tk.core.engine.predict.predict_batches`).

    Raises:
        TkError: see :func:`load_run`; the task has no ``predict``; or the device or
            precision is not available.
    """
    overrides = list(overrides) + ([f"train.device={device}"] if device else [])
    task, model = load_run(run_dir, checkpoint, overrides, ema=ema, weights=weights)
    if type(task).predict is Task.predict:
        raise TkError(f"task {task.name or type(task).__name__!r} does not support prediction "
                      f"(its Task class has no predict method); use `tk eval` for metrics")
    target = resolve_device(task.cfg.train.device)
    precision = Precision(task.cfg.train.precision, target)
    model.to(target).eval()
    return predict_batches(task, model, inputs, batch_size, precision.autocast)


def average_run(run_dir: str | Path, last_k: int, output: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """``tk average``: average the weights of a run's last ``last_k`` step checkpoints (the
    Transformer paper's checkpoint averaging) and write them to ``output``.

    The run is assembled (mode "average") with the newest checkpoint's task state and the
    averaged weights must load into its model, so the result is known to work. A ``.pt``
    output is a tk checkpoint (weights, task state, config, step range) that
    ``tk eval --checkpoint`` and ``tk predict --checkpoint`` accept; a ``.safetensors``
    output holds the bare weights (``--weights``), with the run's task files copied next
    to it.

    Returns:
        ``{"output", "steps"}``.

    Raises:
        TkError: too few step checkpoints, checkpoints of different models, an output
            name that is neither ``.pt`` nor ``.safetensors``, or an output that may not be
            written (:func:`~tk.core.run.outputs.check_output`: an existing file only with
            ``overwrite`` and only if ``tk average`` wrote it; never inside a run's
            checkpoints), or a folder whose ``artifacts/`` hold another run's task files.
    """
    run_dir, output = Path(run_dir), Path(output)
    if output.suffix not in (".pt", ".safetensors"):
        raise TkError(f"-o {output}: name a .pt file (a tk checkpoint for --checkpoint) or a .safetensors file "
                      f"(bare weights for --weights)")
    check_output(output, "tk average", overwrite, sources=[run_dir])
    steps = step_checkpoints(run_dir)
    if len(steps) < last_k:
        raise TkError(f"--last {last_k}: {run_dir} holds {len(steps)} step checkpoint(s) "
                      f"({', '.join(str(s) for s, _ in steps) or 'none'}); lower --last, or train with "
                      f"train.keep_last>={last_k} and train.save_every=N")
    chosen = steps[-last_k:]
    averaged = average_checkpoints([p for _, p in chosen])
    newest = load_checkpoint(chosen[-1][1], full_model=False)  # its task state and config
    task, _, _ = _assemble_saved(run_dir, _SavedRun(*_config(run_dir, []), chosen[-1][1], newest, averaged), "average")
    step_range = [s for s, _ in chosen]
    if output.suffix == ".pt":
        save_checkpoint(output, {"model": averaged, "task_state": task.state_dict(), "config": newest.get("config"),
                                 "task": newest.get("task"), "step": step_range[-1], "averaged_steps": step_range,
                                 WRITTEN_BY: "tk average"})
    else:
        check_merge(task.files.dir, output.parent / ARTIFACTS_DIR, output)
        export_safetensors(averaged, output, metadata=tk_metadata(
            task.name, step_range[-1], averaged_steps=",".join(map(str, step_range)), **{WRITTEN_BY: "tk average"}))
        task.files.copy_to(output.parent)
    return {"output": str(output), "steps": step_range}
