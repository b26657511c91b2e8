"""Accuracy and macro-F1 of a classifier, from one confusion matrix."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from tk.core.metrics import Metric


class ClassificationMetrics(Metric):
    """Counts (true, predicted) pairs; ``compute`` returns ``{"accuracy", "macro_f1"}``.

    Macro-F1 is the unweighted mean over classes of ``2 tp / (2 tp + fp + fn)``, over the
    classes that occur as a target or a prediction (sklearn's ``f1_score(average="macro")``
    up to classes absent from both).

    Args:
        num_classes: C; logits are (B, C), ``batch["labels"]`` (B,) class indices.
    """

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.add_state("matrix", torch.zeros(num_classes, num_classes, dtype=torch.long))

    def update(self, out: Any, batch: Mapping[str, Any]) -> None:
        logits = out.outputs.detach()
        target = batch["labels"].to(logits.device)
        C = self.num_classes
        pairs = torch.bincount(target * C + logits.argmax(-1), minlength=C * C).view(C, C)
        self.matrix += pairs.to(self.matrix.device)

    def keys(self) -> list[str]:
        return ["accuracy", "macro_f1"]

    def compute(self) -> dict[str, float]:
        m = self.matrix.double().cpu()
        total = m.sum().item()
        tp = m.diagonal()
        fp, fn = m.sum(0) - tp, m.sum(1) - tp
        present = (tp + fp + fn) > 0
        f1 = (2 * tp / (2 * tp + fp + fn).clamp(min=1))[present]
        return {"accuracy": tp.sum().item() / total if total else float("nan"),
                "macro_f1": f1.mean().item() if present.any() else float("nan")}
