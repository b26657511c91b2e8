"""DeiT distillation in image_classification: the ``distill:`` section with a timm teacher.

The section, the teacher-run loading and the loss are core's (:mod:`tk.core.distill`);
this module adds a teacher given as a timm model name (random, pretrained, or a weights
file). Loss, as DeiT (Touvron et al., 2021, https://arxiv.org/abs/2012.12877):
``(1 - alpha) * CE(cls_logits, labels) + alpha * D(dist_logits, teacher_logits)``; a model
without a distillation token uses its single head for both terms.

Normalisation of the soft term: :func:`tk.core.losses.kl_distillation_loss` sums the KL
over classes and items; the engine divides by the batch size B, i.e. timm/PyTorch
``batchmean``. DeiT's reference code divides the summed KL by ``B * C`` (``numel``), so
its soft term is ``C`` times smaller than tk's for the same ``alpha`` (10x on CIFAR-10):
tk keeps ``batchmean``, the mathematically correct KL, and a recipe porting a DeiT
``alpha`` for ``soft`` should be aware of that factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
from torch import nn

from tk.core.config import did_you_mean
from tk.core.distill import DistillConfig as CoreDistillConfig
from tk.core.distill import check_distill as check_core_distill
from tk.core.distill import distillation_loss, load_teacher_run, teacher_run_problem, weights_sha256
from tk.core.errors import TkError

__all__ = ["DistillConfig", "check_distill", "distillation_loss", "load_teacher", "teacher_problems", "weights_sha256"]


@dataclass
class DistillConfig(CoreDistillConfig):
    """The recipe's ``distill:`` section: core's, plus a timm teacher."""

    teacher: str | None = None  # a timm model name, or a tk image classification run dir / checkpoint file
    teacher_pretrained: bool = False  # timm teacher: load timm's pretrained weights (hub)
    teacher_file: str | None = None  # timm teacher: weights file (.safetensors / .pth) instead of the hub


def check_distill(cfg: DistillConfig) -> list[str]:
    """Problems of the ``distill:`` section."""
    problems = check_core_distill(cfg)
    if cfg.cache and cfg.type != "none":
        problems.append("distill.cache: image batches are augmented (crops, flips, Mixup), so the teacher's "
                        "logits change every step; set distill.cache false")
    # a path may be a teacher run still to be trained: paths are checked when the run starts;
    # a bare name must be a timm model, so a typo fails here, before anything runs
    name = cfg.teacher or ""
    looks_like_path = "/" in name or "\\" in name or name.endswith((".pt", ".pth", ".safetensors"))
    if (cfg.type != "none" and name and not looks_like_path and not Path(name).expanduser().exists()
            and not timm.is_model(name)):
        problems.append(f"distill.teacher ({name!r}) is not a timm model name{did_you_mean(name, timm.list_models())}"
                            f" (a tk teacher run is given as a path, e.g. runs/{name})")
    return problems


def teacher_problems(cfg: DistillConfig, task_name: str) -> list[str]:
    """A missing teacher run or teacher file, found before the run starts (as ``load_teacher`` would)."""
    if cfg.type == "none" or not cfg.teacher:
        return []
    if Path(cfg.teacher).expanduser().exists() or not timm.is_model(cfg.teacher):
        problem = teacher_run_problem(cfg.teacher, task_name)
        return [problem] if problem else []
    if cfg.teacher_file is not None and not Path(cfg.teacher_file).expanduser().is_file():
        return [f"distill.teacher_file: {cfg.teacher_file} does not exist; give the teacher's weights file"]
    return []


def load_teacher(cfg: DistillConfig, class_names: list[str]) -> tuple[nn.Module, dict[str, str]]:
    """The teacher model and its record ``{"teacher": path or name, "sha256": ...}``.

    A tk run dir (or one of its checkpoint files) loads with ``load_run``; its class names
    must equal ``class_names``. A timm name builds timm's model (random, pretrained, or
    ``teacher_file``); pretrained weights must have ``len(class_names)`` outputs.

    Raises:
        TkError: an unknown teacher, other class names, or another number of outputs.
    """
    from tk.core.engine.inference import load_run  # lazy: the engine imports tasks

    if Path(cfg.teacher).expanduser().exists():
        _, teacher, record = load_teacher_run(cfg.teacher, "image_classification", class_names, load_run)
        return teacher, record
    return _timm_teacher(cfg, len(class_names))


def _timm_teacher(cfg: DistillConfig, num_classes: int) -> tuple[nn.Module, dict[str, str]]:
    if not timm.is_model(cfg.teacher):
        raise TkError(f"distill.teacher: {cfg.teacher!r} is neither an existing run dir nor a timm model name")
    if cfg.teacher_file is not None and not Path(cfg.teacher_file).expanduser().is_file():
        raise TkError(teacher_problems(cfg, "image_classification")[0])
    pretrained = cfg.teacher_pretrained or cfg.teacher_file is not None
    kwargs: dict[str, Any] = {"pretrained": pretrained}
    if cfg.teacher_file is not None:
        kwargs["pretrained_cfg_overlay"] = {"file": str(Path(cfg.teacher_file).expanduser())}
    if not pretrained:
        kwargs["num_classes"] = num_classes
    try:
        teacher = timm.create_model(cfg.teacher, **kwargs)
    except Exception as e:  # timm raises many kinds (hub offline, bad file, shape mismatch)
        raise TkError(f"distill.teacher: cannot build timm teacher {cfg.teacher!r}: {e}") from e
    if teacher.num_classes != num_classes:
        raise TkError(f"distill.teacher: the timm teacher {cfg.teacher!r} predicts {teacher.num_classes} classes but "
                      f"this run has {num_classes}; distil from a teacher trained on the same classes")
    source = str(Path(cfg.teacher_file).expanduser().resolve()) if cfg.teacher_file else cfg.teacher
    return teacher, {"teacher": source, "sha256": weights_sha256(teacher)}
