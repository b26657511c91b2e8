"""What one task step hands to the engine and to the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["StepOutput", "EvalContext"]


@dataclass
class StepOutput:
    """What ``Task.loss`` returns for one (micro-)batch.

    Attributes:
        loss: the loss *summed* over the batch's items (tokens, images, ...), a scalar
            tensor. The engine divides by the total ``num_items`` of all accumulated
            micro-batches (and processes), so gradient accumulation is exact.
        num_items: how many items ``loss`` is summed over (non-PAD tokens for a
            token-level loss, samples for a sample-level one).
        logs: extra scalars to log, each already summed over the batch like ``loss``
            (the engine reports ``logs[k] / num_items``); the same keys on every batch,
            since processes sum them together every update.
        outputs: anything the task's metrics need (logits, predictions).
    """

    loss: torch.Tensor
    num_items: int | torch.Tensor
    logs: dict[str, float | torch.Tensor] = field(default_factory=dict)
    outputs: Any = None


@dataclass(frozen=True)
class EvalContext:
    """Which evaluation a task's ``eval_step`` and ``build_metrics`` serve.

    A task uses it to run expensive decoding (beam search, sampling) only where the
    recipe asks, e.g. ``ctx.every(4)``: on every 4th periodic evaluation and always
    on the final and stand-alone ones.

    Attributes:
        split: ``"val"``, ``"test"``, ...
        step: optimizer updates done when the evaluation runs.
        kind: ``"periodic"`` (during training), ``"final"`` (after the last update)
            or ``"standalone"`` (``tk eval``, outside training).
        index: evaluations of this run before this one (0 for the first).
        prefix: the key prefix of the results (``split``, or e.g. ``"val_ema"``).
    """

    split: str = "val"
    step: int = 0
    kind: Literal["periodic", "final", "standalone"] = "standalone"
    index: int = 0
    prefix: str = ""

    @property
    def key_prefix(self) -> str:
        """``prefix`` or, when empty, ``split``."""
        return self.prefix or self.split

    def every(self, n: int | None) -> bool:
        """True on every ``n``-th periodic evaluation (the first included) and on every
        final or stand-alone one; ``n`` None or 0 means final/stand-alone only."""
        if self.kind != "periodic":
            return True
        return bool(n) and self.index % n == 0
