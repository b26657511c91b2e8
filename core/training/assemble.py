"""One assembly path for every command: the documented order in which a run's task,
data and model are built.

    1. construct the task with its run dir      Task(cfg, run_dir)
    2. restore its saved state                  task.load_state_dict(...)   (resume, eval, predict, average)
    3. adopt a declared backbone source         task.pretrained_backbone    (model.pretrained_from: its shape and
                                                                             files; a restored run: the recorded shape)
       set it up                                task.setup(resume=...)      (True where a saved run is rebuilt:
                                                                             load task files, never recompute)
    4. build the data                           loaders, datasets           (train, resume, eval, summary)
    5. build the model                          task.build_model()
    6. load pretrained weights                  the declared backbone's tensors, then
                                                task.init_pretrained(model) (a fresh training run only)
    7. add LoRA adapters, freeze the rest       apply_lora(model, ...)      (when the model: section has
                                                                             a lora: mapping; every mode, so a
                                                                             saved LoRA run's weights fit;
                                                                             task.lora_names(model): targets
                                                                             by the source family's names)
    8. fill the adapters                        task.init_adapters(model)   (a fresh training run only)

With several processes, steps 3-4 run on rank 0 first (downloads, tokenizer training,
task files), then on the other ranks, which find what rank 0 wrote.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, Mapping

from torch import nn

from tk.core.config import RunConfig
from tk.core.nn.lora import apply_lora
from tk.core.task import Task

log = logging.getLogger(__name__)

__all__ = ["Mode", "AssembledRun", "assemble", "MODES"]

Mode = Literal["train", "resume", "eval", "predict", "summary", "average"]
MODES = ("train", "resume", "eval", "predict", "summary", "average")
RESTORING = ("resume", "eval", "predict", "average")  # modes that rebuild a saved run


@dataclass
class AssembledRun:
    """What :func:`assemble` built."""

    task: Task
    model: nn.Module
    data: Any = None  # whatever ``build_data`` returned (e.g. the loaders)


def assemble(cfg: RunConfig, task_cls: type[Task], run_dir: str | Path | None, mode: Mode, *,
             state: Mapping[str, Any] | None = None, build_data: Callable[[Task], Any] | None = None,
             main_first: Callable[[], ContextManager] = contextlib.nullcontext) -> AssembledRun:
    """Build a run's task, data and model in the one documented order (module docstring).

    Args:
        cfg: the resolved run config.
        task_cls: its task class.
        run_dir: the run directory where it is NOW (None for ``tk summary``).
        mode: which command builds it: "train" (a fresh run), "resume", "eval",
            "predict", "summary" or "average".
        state: a tk checkpoint (its ``task_state`` is restored before ``setup``).
        build_data: step 4, e.g. ``lambda task: task.build_loader("val", spec)``.
        main_first: a context manager factory that runs steps 3-4 on rank 0 first
            (``tk.core.distributed.main_process_first`` when distributed).

    Returns:
        The task, the model (on the CPU, in training mode) and the data.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} must be one of {MODES}")
    task = task_cls(cfg, run_dir)
    if state is not None:
        task.load_state_dict(state.get("task_state") or {})
    with main_first():
        backbone = task.pretrained_backbone  # a declared backbone source: its shape and files before the set-up
        source = backbone.adopt(task, mode) if backbone is not None else None
        task.setup(resume=mode in RESTORING)
        data = build_data(task) if build_data is not None else None
    model = task.build_model()
    if mode == "train":
        if source is not None:
            backbone.load(model, source)
        task.init_pretrained(model)
    lora = getattr(cfg.sections.get("model"), "lora", None)
    if lora is not None:
        adapted = apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.trainable,
                             names=task.lora_names(model))
        if mode == "train":  # in train.log: what trains and what is frozen
            task.init_adapters(model)
            log.info(lora_report(model, adapted, lora.rank))
    return AssembledRun(task, model, data)


def lora_report(model: nn.Module, adapted: list[str], rank: int) -> str:
    """One line: the adapted layers, what else trains, how much is frozen."""
    params = list(model.named_parameters())
    train = [(n, p) for n, p in params if p.requires_grad]
    others = sorted(n for n, _ in train if not n.endswith((".lora_A", ".lora_B")))
    frozen = [p for _, p in params if not p.requires_grad]
    shown = ", ".join(adapted[:4]) + (f", ... ({len(adapted)} in all)" if len(adapted) > 4 else "")
    return (f"model.lora: rank-{rank} adapters on {len(adapted)} Linear layers ({shown}); "
            f"{sum(p.numel() for _, p in train):,} parameters train (the adapters"
            + (f" and {', '.join(others)}" if others else "") + f"), {len(frozen)} tensors "
            f"({sum(p.numel() for p in frozen):,} parameters) are frozen")
