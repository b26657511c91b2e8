"""Exponential moving average (EMA) of model weights, evaluated instead of the raw model.

Polyak averaging: https://doi.org/10.1137/0330046 ; used by DeiT (https://arxiv.org/abs/2012.12877)
and timm's ModelEma.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["ModelEMA"]


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / DataParallel / torch.compile wrappers."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)


class ModelEMA:
    """Keeps ``ema = d * ema + (1 - d) * param`` for every trainable parameter after each
    update (a frozen one never changes, so its copy is its average);
    persistent buffers (BatchNorm statistics, counters) are copied from the model as they
    are. Non-persistent buffers (caches a module rebuilds itself, such as rotary cos/sin
    tables that grow with the longest sequence seen) are left to each copy.

    Decay warmup: with ``warmup_steps = W > 0`` the decay of update ``n`` (counting from
    0) is ``min(decay, (1 + n) / (W + n))``, so early averages are not dominated by the
    random init (``W = 10`` is TensorFlow's ``num_updates`` rule). ``W = 0`` uses
    ``decay`` throughout.

    Args:
        model: the model to track (a frozen copy is made; wrappers are unwrapped).
        decay: the decay after warmup, in [0, 1).
        warmup_steps: decay warmup length W (0: none).
        device: where to keep the copy (default: the model's device), e.g. "cpu" to
            save GPU memory.

    Attributes:
        module: the averaged model, in eval mode with ``requires_grad=False``.
        step: number of updates so far.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup_steps: int = 0, device: str | None = None) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if warmup_steps < 0:
            raise ValueError(f"EMA warmup_steps must be >= 0, got {warmup_steps}")
        self.decay = decay
        self.warmup_steps = warmup_steps
        self.step = 0
        self.module = copy.deepcopy(_unwrap(model)).eval().requires_grad_(False)
        state_keys = set(self.module.state_dict())
        self._buffer_names = [name for name, _ in self.module.named_buffers() if name in state_keys]
        if device is not None:
            self.module.to(device)

    def current_decay(self) -> float:
        """The decay the next :meth:`update` will use."""
        if self.warmup_steps == 0:
            return self.decay
        return min(self.decay, (1 + self.step) / (self.warmup_steps + self.step))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current weights into the average (call after each optimizer step)."""
        d = self.current_decay()
        src = _unwrap(model)
        src_params = dict(src.named_parameters())
        for name, ema_p in self.module.named_parameters():
            if ema_p.is_floating_point() and not src_params[name].requires_grad:
                continue  # frozen (LoRA, a frozen backbone): equal to its average already
            p = src_params[name].detach().to(ema_p.device, ema_p.dtype)
            if ema_p.is_floating_point():
                ema_p.lerp_(p, 1.0 - d)  # ema + (1 - d) * (p - ema) == d * ema + (1 - d) * p
            else:
                ema_p.copy_(p)
        src_buffers, ema_buffers = dict(src.named_buffers()), dict(self.module.named_buffers())
        for name in self._buffer_names:
            ema_buffers[name].copy_(src_buffers[name])
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "step": self.step, "decay": self.decay,
                "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the average and the update count (decay settings stay as constructed)."""
        self.module.load_state_dict(state["module"])
        self.step = int(state["step"])
