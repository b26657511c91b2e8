"""Masked-LM metrics over the masked tokens: top-1 (masked accuracy), top-5 and perplexity."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tk.core.step import StepOutput
from tk.core.text import Perplexity


class MaskedLMMetrics(Perplexity):
    """``top1`` / ``top5``: fraction of masked tokens whose original id is the model's first /
    among its five first guesses; ``perplexity``: ``exp`` of the mean masked-token loss.

    ``update`` reads ``out.outputs = (logits (N, V), targets (N,))`` of the N masked tokens.
    """

    def __init__(self) -> None:
        super().__init__("perplexity")
        self.add_state("correct", torch.zeros(2, dtype=torch.float64))  # top-1, top-5 hits

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        super().update(out, batch)
        logits, targets = out.outputs
        if targets.numel() == 0:
            return
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # (N, k)
        hits = top.eq(targets.unsqueeze(-1))
        found = torch.stack([hits[:, 0].sum(), hits.any(-1).sum()])
        self.correct += found.to(self.correct.device, torch.float64)

    def keys(self) -> list[str]:
        return ["top1", "top5", "perplexity"]

    def compute(self) -> dict[str, float]:
        tokens = float(self.tokens)
        top1, top5 = (float(c) / tokens if tokens else float("nan") for c in self.correct)
        return {"top1": top1, "top5": top5, **super().compute()}
