"""Knowledge distillation (DeiT): the ``distill:`` section, the frozen teacher and the loss.

Loss, as DeiT (Touvron et al., 2021, https://arxiv.org/abs/2012.12877):
``(1 - alpha) * CE(cls_logits, labels) + alpha * D(dist_logits, teacher_logits)`` with
``D`` = ``tau**2 * KL(softmax(teacher / tau) || softmax(student / tau))`` ("soft") or
``CE(dist_logits, argmax(teacher))`` ("hard"). A model without a distillation token uses
its single head for both terms (classic knowledge distillation).

Normalisation of the soft term: :func:`tk.core.losses.kl_distillation_loss` sums the KL
over classes and items; the engine divides by the batch size B, i.e. timm/PyTorch
``batchmean``. DeiT's reference code divides the summed KL by ``B * C`` (``numel``), so
its soft term is ``C`` times smaller than tk's for the same ``alpha`` (10x on CIFAR-10):
tk keeps ``batchmean``, the mathematically correct KL, and a recipe porting a DeiT
``alpha`` for ``soft`` should be aware of that factor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.config import did_you_mean
from tk.core.errors import TkError
from tk.core.losses import cross_entropy_sum, kl_distillation_loss


@dataclass
class DistillConfig:
    """The recipe's ``distill:`` section."""

    type: Literal["none", "soft", "hard"] = "none"  # distillation loss on the dist head (or the single head)
    alpha: float = 0.5  # weight of the distillation term; (1 - alpha) on the label term
    tau: float = 1.0  # soft distillation temperature (> 0)
    teacher: str | None = None  # a timm model name, or a tk image classification run dir / checkpoint file
    teacher_pretrained: bool = False  # timm teacher: load timm's pretrained weights (hub)
    teacher_file: str | None = None  # timm teacher: weights file (.safetensors / .pth) instead of the hub


def check_distill(cfg: DistillConfig) -> list[str]:
    """Problems of the ``distill:`` section."""
    problems = []
    if cfg.type != "none" and not cfg.teacher:
        problems.append(f"distill.teacher: distill.type {cfg.type!r} needs a teacher (a timm model name or a tk run dir)")
    if not 0.0 <= cfg.alpha <= 1.0:
        problems.append(f"distill.alpha ({cfg.alpha}) must be in [0, 1]")
    if not cfg.tau > 0:
        problems.append(f"distill.tau ({cfg.tau}) must be > 0")
    # a path may be a teacher run still to be trained: paths are checked when the run starts;
    # a bare name must be a timm model, so a typo fails here, before anything runs
    name = cfg.teacher or ""
    looks_like_path = "/" in name or "\\" in name or name.endswith((".pt", ".pth", ".safetensors"))
    if cfg.type != "none" and name and not looks_like_path and not Path(name).expanduser().exists():
        if not timm.is_model(name):
            problems.append(f"distill.teacher ({name!r}) is not a timm model name{did_you_mean(name, timm.list_models())}"
                            f" (a tk teacher run is given as a path, e.g. runs/{name})")
    return problems


def weights_sha256(model: nn.Module) -> str:
    """sha256 over the model's state dict (names, then fp32 CPU bytes of each tensor, in order)."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path.is_file() and path.parent.name == "checkpoints")


def load_teacher(cfg: DistillConfig, class_names: list[str]) -> tuple[nn.Module, dict[str, str]]:
    """The teacher model and its record ``{"teacher": path or name, "sha256": ...}``.

    A tk run dir (or one of its checkpoint files) loads with ``load_run``; its class names
    must equal ``class_names``. A timm name builds timm's model (random, pretrained, or
    ``teacher_file``); pretrained weights must have ``len(class_names)`` outputs.

    Raises:
        TkError: an unknown teacher, other class names, or another number of outputs.
    """
    from tk.core.engine.inference import load_run  # lazy: the engine imports tasks

    path = Path(cfg.teacher).expanduser()
    if path.exists():
        if not _is_run(path):
            raise TkError(f"distill.teacher: {cfg.teacher} is not a tk run dir (no config.yaml) nor a file in "
                          f"its checkpoints/; give a run dir of an image classification run or a timm model name")
        run_dir, checkpoint = (path, "best") if path.is_dir() else (path.parent.parent, str(path))
        task, teacher = load_run(run_dir, checkpoint)
        names = list(getattr(task, "class_names", []))
        if names != list(class_names):
            raise TkError(f"distill.teacher: the teacher run {run_dir} has classes {names[:10]} but this run has "
                          f"{list(class_names)[:10]}; teacher and student must share the class list (classes.json)")
        return teacher, {"teacher": str(path.resolve()), "sha256": weights_sha256(teacher)}
    return _timm_teacher(cfg, len(class_names))


def _timm_teacher(cfg: DistillConfig, num_classes: int) -> tuple[nn.Module, dict[str, str]]:
    if not timm.is_model(cfg.teacher):
        raise TkError(f"distill.teacher: {cfg.teacher!r} is neither an existing run dir nor a timm model name")
    if cfg.teacher_file is not None and not Path(cfg.teacher_file).expanduser().is_file():
        raise TkError(f"distill.teacher_file: {cfg.teacher_file} does not exist; give the teacher's weights file")
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


def distillation_loss(cfg: DistillConfig, student: Tensor | tuple[Tensor, Tensor], labels: Tensor,
                      teacher_logits: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, int, dict[str, Tensor]]:
    """DeiT's loss, summed over the batch.

    Args:
        cfg: type, alpha, tau.
        student: (B, C) logits, or the DeiT pair ``(cls_logits, dist_logits)``.
        labels: (B,) class indices or (B, C) (mixed) soft targets.
        teacher_logits: (B, C) teacher scores on the same images.
        label_smoothing: for the label term on integer labels.

    Returns:
        ``(loss_sum, B, logs)``; ``logs`` holds the summed ``loss_base`` and ``loss_distill``.
    """
    cls_logits, dist_logits = student if isinstance(student, tuple) else (student, student)
    base, count = cross_entropy_sum(cls_logits, labels, label_smoothing=label_smoothing)
    if cfg.type == "soft":
        distill, _ = kl_distillation_loss(dist_logits, teacher_logits, cfg.tau)
    else:  # hard
        distill = F.cross_entropy(dist_logits.float(), teacher_logits.argmax(-1), reduction="sum")
    loss = (1.0 - cfg.alpha) * base + cfg.alpha * distill
    return loss, count, {"loss_base": base.detach(), "loss_distill": distill.detach()}
