"""SFT metrics over the target tokens: ``token_accuracy`` (the model's first guess is the target)
and ``perplexity``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tk.core.step import StepOutput
from tk.core.text import Perplexity

IGNORE = -100


class SFTMetrics(Perplexity):
    """``update`` reads ``out.outputs = (logits (B, T, V), targets (B, T))`` (-100: not a target)."""

    def __init__(self) -> None:
        super().__init__("perplexity")
        self.add_state("correct", torch.zeros((), dtype=torch.float64))

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        super().update(out, batch)
        logits, targets = out.outputs
        keep = targets.ne(IGNORE)
        self.correct += (logits.argmax(-1).eq(targets) & keep).sum().to(self.correct.device, torch.float64)

    def keys(self) -> list[str]:
        return ["token_accuracy", "perplexity"]

    def compute(self) -> dict[str, float]:
        tokens = float(self.tokens)
        return {"token_accuracy": float(self.correct) / tokens if tokens else float("nan"), **super().compute()}
