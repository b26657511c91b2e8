"""Mixup / CutMix on device batches (timm's ``Mixup``) and the task's ``loss:`` options.

Mixup: Zhang et al. 2018, https://arxiv.org/abs/1710.09412;
CutMix: Yun et al. 2019, https://arxiv.org/abs/1905.04899;
label smoothing: Szegedy et al. 2016, https://arxiv.org/abs/1512.00567.
The loss itself is ``tk.core.losses.cross_entropy_sum``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from timm.data import Mixup


@dataclass
class LossConfig:
    """The recipe's ``loss:`` section."""

    label_smoothing: float = 0.0  # epsilon in [0, 1), training only; Mixup/CutMix targets are smoothed alike

    def check(self) -> list[str]:
        """Range checks, naming the ``loss.*`` key."""
        if not 0.0 <= self.label_smoothing < 1.0:
            return [f"loss.label_smoothing ({self.label_smoothing}) must be in [0, 1)"]
        return []


@dataclass
class MixupConfig:
    """The recipe's ``mixup:`` section (mixing is on when either alpha is > 0)."""

    mixup_alpha: float = 0.0  # Beta(a, a) parameter of Mixup; 0 = Mixup off
    cutmix_alpha: float = 0.0  # Beta(a, a) parameter of CutMix; 0 = CutMix off
    prob: float = 1.0  # probability of mixing a batch (or element, see mode)
    switch_prob: float = 0.5  # probability of CutMix instead of Mixup when both are on
    mode: Literal["batch", "pair", "elem"] = "batch"  # draw mixing params per batch, pair or element
    label_smoothing: float | None = None  # moved to loss.label_smoothing; any value here is a config error

    @property
    def enabled(self) -> bool:
        return self.prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)


def check_mixup(cfg: MixupConfig, batch_size: int | None) -> list[str]:
    """Config problems of the ``mixup:`` section, one message per broken rule."""
    problems = []
    if cfg.label_smoothing is not None:
        problems.append(f"mixup.label_smoothing moved to loss.label_smoothing: write "
                        f"`loss: {{label_smoothing: {cfg.label_smoothing}}}` instead")
    for key in ("mixup_alpha", "cutmix_alpha"):
        if getattr(cfg, key) < 0:
            problems.append(f"mixup.{key} ({getattr(cfg, key)}) must be >= 0 (0 turns it off)")
    for key in ("prob", "switch_prob"):
        if not 0.0 <= getattr(cfg, key) <= 1.0:
            problems.append(f"mixup.{key} ({getattr(cfg, key)}) must be in [0, 1]")
    if cfg.enabled and batch_size is not None and batch_size % 2:
        # timm mixes each sample with its mirror in the batch, so the size must be even
        problems.append(f"train.batch_size: Mixup/CutMix needs an even batch size, got {batch_size}")
    return problems


def build_mixup(cfg: MixupConfig, num_classes: int, label_smoothing: float = 0.0) -> Mixup | None:
    """timm's Mixup for ``cfg``, or None when off. Its soft targets carry ``label_smoothing``
    (``loss.label_smoothing``), so the loss must not smooth them again."""
    if not cfg.enabled:
        return None
    return Mixup(
        mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, prob=cfg.prob,
        switch_prob=cfg.switch_prob, mode=cfg.mode, label_smoothing=label_smoothing,
        num_classes=num_classes,
    )
