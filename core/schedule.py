"""Learning-rate schedules as pure multipliers of the peak lr, plus a LambdaLR builder.

Noam / inverse square root: "Attention Is All You Need" (https://arxiv.org/abs/1706.03762), eq. 3.
Cosine decay: SGDR (https://arxiv.org/abs/1608.03983).

Step convention: ``step`` counts optimizer updates and the FIRST update uses ``step = 1``.
The scheduler from :func:`build_scheduler` sets the lr for update 1 at construction and
``scheduler.step()`` after update ``s`` sets the lr of update ``s + 1``. So warmup reaches
the peak lr exactly on update ``warmup_steps``, and cosine/linear reach the floor on update
``total_steps``. With ``warmup_steps = W > 0`` update ``s <= W`` uses
``warmup_init_ratio + (1 - warmup_init_ratio) * s / W`` (never a wasted zero-lr update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["ScheduleConfig", "lr_multiplier", "build_scheduler"]

_NAMES = ("constant", "warmup_cosine", "inverse_sqrt", "linear")


@dataclass
class ScheduleConfig:
    """The recipe's ``schedule:`` section."""

    name: Literal["constant", "warmup_cosine", "inverse_sqrt", "linear"] = "constant"  # lr shape after warmup
    warmup_steps: int = 0  # linear warmup length in optimizer updates (0: none)
    min_lr_ratio: float = 0.0  # cosine/linear floor, as a fraction of the peak lr
    noam_d_model: int | None = None  # inverse_sqrt: use Noam's d_model**-0.5 formula (optim.lr = factor)
    warmup_init_ratio: float = 0.0  # lr at the start of warmup, as a fraction of the peak lr

    def check(self) -> list[str]:
        """Range checks; one message per broken rule, naming the ``schedule.*`` key."""
        errors = []
        if self.name not in _NAMES:
            errors.append(f"schedule.name must be one of {list(_NAMES)}, got {self.name!r}")
        if self.warmup_steps < 0:
            errors.append(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.warmup_init_ratio <= 1.0:
            errors.append(f"schedule.warmup_init_ratio must be in [0, 1], got {self.warmup_init_ratio}")
        if self.noam_d_model is not None:
            if self.noam_d_model <= 0:
                errors.append(f"schedule.noam_d_model must be > 0, got {self.noam_d_model}")
            if self.name != "inverse_sqrt":
                errors.append(f"schedule.noam_d_model needs schedule.name: inverse_sqrt, got {self.name!r}")
            if self.warmup_steps <= 0:
                errors.append("schedule.noam_d_model needs schedule.warmup_steps > 0 (the paper uses 4000)")
        return errors


def _decay_progress(step: int, total_steps: int, warmup: int) -> float:
    """Fraction of the post-warmup phase done after update ``step``, in [0, 1]."""
    span = total_steps - warmup
    if span <= 0:
        return 1.0
    return min(max((step - warmup) / span, 0.0), 1.0)


def lr_multiplier(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """The lr of update ``step`` as a multiple of the peak lr (``optim.lr``).

    Args:
        step: optimizer update index, 1 for the first update (values < 1 are treated as 1).
        total_steps: the number of updates of the run (cosine/linear end there).
        cfg: the ``schedule:`` section.

    Returns:
        The multiplier; the group lr is ``optim.lr * lr_scale * multiplier``. For Noam
        (``noam_d_model`` set) it is ``d_model**-0.5 * min(step**-0.5, step * W**-1.5)``.
    """
    step = max(int(step), 1)
    w = cfg.warmup_steps
    if cfg.name == "inverse_sqrt" and cfg.noam_d_model is not None:
        return cfg.noam_d_model**-0.5 * min(step**-0.5, step * w**-1.5)
    if step <= w:
        return cfg.warmup_init_ratio + (1.0 - cfg.warmup_init_ratio) * step / w
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "inverse_sqrt":
        # fairseq's inverse_sqrt: continuous at the peak, decays as 1/sqrt(step) after it.
        return math.sqrt(max(w, 1) / step)
    floor = cfg.min_lr_ratio
    t = _decay_progress(step, total_steps, w)
    if cfg.name == "warmup_cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
    if cfg.name == "linear":
        return floor + (1.0 - floor) * (1.0 - t)
    raise ValueError(f"schedule.name must be one of {list(_NAMES)}, got {cfg.name!r}")


def _lambda(last_epoch: int, total_steps: int, cfg: ScheduleConfig) -> float:
    # LambdaLR's counter starts at 0 for the first update; our steps start at 1.
    return lr_multiplier(last_epoch + 1, total_steps, cfg)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int
) -> LambdaLR:
    """A LambdaLR that sets each group's lr to ``initial_lr * lr_multiplier(step)``.

    Each group's initial lr already carries its layer-wise ``lr_scale`` (see
    ``tk.core.optim.build_optimizer``), so the ratios between groups are kept. Call
    ``scheduler.step()`` once after every optimizer update. The result is picklable and
    its ``state_dict()`` restores the position on resume.

    Args:
        optimizer: the optimiser; its current group lrs are taken as the peak lrs.
        cfg: the ``schedule:`` section.
        total_steps: number of optimizer updates of the whole run (>= 1).

    Raises:
        ValueError: a config value out of range, or ``total_steps < 1``.
    """
    errors = cfg.check()
    if total_steps < 1:
        errors.append(f"total_steps (train.max_steps) must be >= 1, got {total_steps}")
    if errors:
        raise ValueError("; ".join(errors))
    return LambdaLR(optimizer, partial(_lambda, total_steps=total_steps, cfg=cfg))
