"""Knowledge distillation for classification tasks: the ``distill:`` section, the teacher
run, the loss, and a per-example cache of the teacher's logits.

Loss (Hinton et al. 2015, https://arxiv.org/abs/1503.02531; DeiT, Touvron et al. 2021,
https://arxiv.org/abs/2012.12877): ``(1 - alpha) * CE(logits, labels) + alpha * D`` with
``D = tau**2 * KL(softmax(teacher / tau) || softmax(student / tau))`` ("soft") or
``CE(student, argmax(teacher))`` ("hard"). A DeiT model passes ``(cls_logits,
dist_logits)``: the label term goes to the first, the distillation term to the second.

A task opts in (``docs/plugins.md``, "Distillation"): ``extra_sections = {"distill":
DistillConfig}``, :func:`check_distill` in ``check_config``, a ``class_names`` list, and
a ``build_teacher`` that loads the teacher run with :func:`load_teacher_run` (handing it
``tk.core.engine.inference.load_run``: core does not import the engine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from tk.core.errors import TkError
from tk.core.losses import cross_entropy_sum, kl_distillation_loss

__all__ = ["DistillConfig", "TeacherLogitsCache", "check_distill", "check_same_teacher", "distillation_loss",
           "load_teacher_run", "teacher_run_problem", "weights_sha256"]


@dataclass
class DistillConfig:
    """The recipe's ``distill:`` section."""

    type: Literal["none", "soft", "hard"] = "none"  # soft: KL to the teacher's softened probs; hard: CE on its argmax
    alpha: float = 0.5  # weight of the distillation term; (1 - alpha) on the label term
    tau: float = 1.0  # soft distillation temperature (> 0); the KL is scaled by tau**2
    teacher: str | None = None  # a finished run dir of the same task and classes (or a file in its checkpoints/)
    cache: bool = False  # reuse each training example's teacher logits after its first use (no augmentation only)


def check_distill(cfg: DistillConfig) -> list[str]:
    """Problems of the ``distill:`` section, one line each (the teacher path is checked when
    the run starts: a recipe may name a teacher run still to be trained)."""
    problems = []
    if cfg.type != "none" and not cfg.teacher:
        problems.append(f"distill.teacher: distill.type {cfg.type!r} needs a teacher (the run dir of a trained run)")
    if not 0.0 <= cfg.alpha <= 1.0:
        problems.append(f"distill.alpha ({cfg.alpha}) must be in [0, 1]")
    if not cfg.tau > 0:
        problems.append(f"distill.tau ({cfg.tau}) must be > 0")
    return problems


def is_run_path(path: Path) -> bool:
    """A run dir (holds ``config.yaml``) or a file in a run's ``checkpoints/``."""
    return (path / "config.yaml").is_file() or (path.is_file() and path.parent.name == "checkpoints")


def weights_sha256(model: nn.Module) -> str:
    """sha256 over the model's state dict (names, then fp32 CPU bytes of each tensor, in order)."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def teacher_run_problem(teacher: str, task_name: str) -> str | None:
    """Why ``distill.teacher`` cannot be a teacher run (missing, or not a run), checked before a
    run starts; None when it may be one (loading it checks its task and classes)."""
    path = Path(teacher).expanduser()
    if not path.exists():
        return (f"distill.teacher: {teacher} does not exist; give the output_dir of a finished {task_name} "
                f"run (train the teacher first)")
    if not is_run_path(path):
        return (f"distill.teacher: {teacher} is not a tk run dir (no config.yaml) nor a file in its "
                f"checkpoints/; give the output_dir of a finished {task_name} run")
    run_dir = path if path.is_dir() else path.parent.parent
    try:
        task = (yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}).get("task")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return None  # loading the run says what is wrong with it
    if isinstance(task, str) and task != task_name:
        return (f"distill.teacher: {run_dir} is a {task} run; a {task_name} student needs a {task_name} teacher "
                f"over the same classes")
    return None


def load_teacher_run(teacher: str, task_name: str, class_names: Sequence[Any],
                     load_run: Callable[[Path, str], tuple[Any, nn.Module]]) -> tuple[Any, nn.Module, dict[str, str]]:
    """The teacher's task, its model (eval mode) and its record ``{"teacher": path, "sha256": ...}``.

    Args:
        teacher: ``distill.teacher``: a run dir, or a checkpoint file in its ``checkpoints/``.
        task_name: the student's task; the teacher run must be of the same task.
        class_names: the student's classes in label order; the teacher's must be equal.
        load_run: ``tk.core.engine.inference.load_run``.

    Raises:
        TkError: a missing path, a path that is not a run, a run of another task or with
            other class names (one line each).
    """
    path = Path(teacher).expanduser()
    problem = teacher_run_problem(teacher, task_name)
    if problem:
        raise TkError(problem)
    run_dir, checkpoint = (path, "best") if path.is_dir() else (path.parent.parent, str(path))
    task, model = load_run(run_dir, checkpoint)
    if task.name != task_name:
        raise TkError(f"distill.teacher: {run_dir} is a {task.name or type(task).__name__} run; a {task_name} "
                      f"student needs a {task_name} teacher over the same classes")
    names = [str(c) for c in getattr(task, "class_names", [])]
    if names != [str(c) for c in class_names]:
        raise TkError(f"distill.teacher: the teacher run {run_dir} has classes {names[:10]} but this run has "
                      f"{[str(c) for c in class_names][:10]}; teacher and student must share the class list "
                      f"(the runs' class-name task files)")
    return task, model, {"teacher": str(path.resolve()), "sha256": weights_sha256(model)}


def check_same_teacher(saved: Mapping[str, str] | None, record: Mapping[str, str]) -> None:
    """A resumed run must get the teacher its checkpoint recorded.

    Raises:
        TkError: another teacher (other weights), naming both.
    """
    if saved is not None and saved.get("sha256") != record["sha256"]:
        raise TkError(f"distill.teacher: this run was trained with teacher {saved.get('teacher')} "
                      f"(sha256 {saved.get('sha256', '?')[:12]}) but now gets {record['teacher']} "
                      f"(sha256 {record['sha256'][:12]}); resume with the original teacher")


def distillation_loss(cfg: DistillConfig, student: Tensor | tuple[Tensor, Tensor], labels: Tensor,
                      teacher_logits: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, int, dict[str, Tensor]]:
    """The distillation loss, summed over the batch (the engine divides by the item count).

    The soft term sums the KL over classes and items, so the mean is timm/PyTorch's
    ``batchmean`` (DeiT's reference code divides by ``B * C`` instead: ``C`` times smaller).

    Args:
        cfg: type ("soft" or "hard"), alpha, tau.
        student: (B, C) logits, or the DeiT pair ``(cls_logits, dist_logits)``.
        labels: (B,) class indices or (B, C) (mixed) soft targets.
        teacher_logits: (B, C) teacher scores on the same inputs.
        label_smoothing: for the label term on integer labels.

    Returns:
        ``(loss_sum, B, logs)``; ``logs`` holds the summed ``loss_base`` and ``loss_distill``.
    """
    cls_logits, dist_logits = student if isinstance(student, tuple) else (student, student)
    base, count = cross_entropy_sum(cls_logits, labels, label_smoothing=label_smoothing)
    if cfg.type == "soft":
        distill, _ = kl_distillation_loss(dist_logits, teacher_logits, cfg.tau)
    else:  # hard
        distill = F.cross_entropy(dist_logits.float(), teacher_logits.detach().argmax(-1), reduction="sum")
    loss = (1.0 - cfg.alpha) * base + cfg.alpha * distill
    return loss, count, {"loss_base": base.detach(), "loss_distill": distill.detach()}


class TeacherLogitsCache:
    """The teacher's (fp32) logits of each training example, computed on its first use.

    Exact only where an example's teacher input is the same every time (no augmentation;
    the teacher is in eval mode, so dropout is off).

    Args:
        size: the number of training examples (indices ``0 .. size - 1``).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.logits: Tensor | None = None  # (size, C), on the device of the first batch
        self.filled: Tensor | None = None  # (size,) bool
        self.computed = 0  # examples sent through the teacher so far

    def get(self, index: Tensor, compute: Callable[[Tensor], Tensor]) -> Tensor:
        """The (B, C) logits of examples ``index`` (B,); ``compute(positions)`` gives those of the
        batch rows ``positions`` not cached yet (a (K,) long tensor of row numbers)."""
        if self.filled is None:
            self.filled = torch.zeros(self.size, dtype=torch.bool, device=index.device)
        missing = (~self.filled[index]).nonzero().squeeze(1)  # (K,) batch rows
        if missing.numel():
            new = compute(missing).detach().float()  # (K, C)
            if self.logits is None:
                self.logits = torch.zeros(self.size, new.shape[-1], device=index.device)
            self.logits[index[missing]] = new
            self.filled[index[missing]] = True
            self.computed += int(missing.numel())
        return self.logits[index]
