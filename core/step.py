"""What one task step hands to the engine and to the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepOutput"]


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
            (the engine reports ``logs[k] / num_items``).
        outputs: anything the task's metrics need (logits, predictions).
    """

    loss: torch.Tensor
    num_items: int | torch.Tensor
    logs: dict[str, float | torch.Tensor] = field(default_factory=dict)
    outputs: Any = None
