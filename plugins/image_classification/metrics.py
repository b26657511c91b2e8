"""Per-class accuracy and the confusion matrix, written as a table and a PNG after evaluation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tk.core.metrics import Metric
from tk.core.step import EvalContext
from tk.core.text.confusion import save_confusion_png


class ConfusionMatrix(Metric):
    """Counts (true class, predicted class) pairs; reports the mean per-class accuracy.

    ``compute`` returns ``{"mean_class_acc": ...}`` (balanced accuracy, over classes seen);
    ``write`` (called by the engine on rank 0) writes ``{out_dir}/{prefix}_per_class.tsv``
    (class, images, correct, accuracy) and ``{out_dir}/{prefix}_confusion.png``.

    Args:
        class_names: the C class names, in label order.
    """

    def __init__(self, class_names: Sequence[str]) -> None:
        super().__init__()
        self.class_names = list(class_names)
        C = len(self.class_names)
        self.add_state("matrix", torch.zeros(C, C, dtype=torch.long))  # rows: true, cols: predicted

    def update(self, out: Any, batch: Mapping[str, Any]) -> None:
        logits = out.outputs["logits"] if isinstance(out.outputs, Mapping) else out.outputs
        logits = logits.detach()
        target = batch["labels"].to(logits.device)
        if target.ndim == 2:  # soft targets: count the dominant class
            target = target.argmax(-1)
        C = len(self.class_names)
        pred = logits.argmax(-1)
        pairs = torch.bincount(target * C + pred, minlength=C * C).view(C, C)
        self.matrix += pairs.to(self.matrix.device)

    def per_class(self) -> list[tuple[str, int, int, float]]:
        """Rows of (class name, images, correct, accuracy); accuracy is NaN for unseen classes."""
        m = self.matrix.cpu()
        totals, correct = m.sum(1).tolist(), m.diagonal().tolist()
        return [(name, n, c, c / n if n else float("nan"))
                for name, n, c in zip(self.class_names, totals, correct)]

    def keys(self) -> list[str]:
        return ["mean_class_acc"]

    def compute(self) -> dict[str, float]:
        seen = [acc for _, n, _, acc in self.per_class() if n]
        return {"mean_class_acc": sum(seen) / len(seen) if seen else float("nan")}

    def write(self, out_dir: Path, ctx: EvalContext) -> None:
        """Write the per-class table and the confusion-matrix PNG into ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / f"{ctx.key_prefix}_per_class.tsv", "w", encoding="utf-8") as f:
            f.write("class\timages\tcorrect\taccuracy\n")
            f.writelines(f"{name}\t{n}\t{c}\t{acc:.4f}\n" for name, n, c, acc in self.per_class())
        save_confusion_png(self.matrix.cpu(), self.class_names, str(out_dir / f"{ctx.key_prefix}_confusion.png"),
                           noun="images")


class HeadAccuracy(Metric):
    """Top-1 accuracy of one DeiT head: ``outputs[head]`` (B, C) logits vs ``batch["labels"]``;
    result key ``top1_{head}`` (e.g. ``val/top1_cls``, ``val/top1_dist``)."""

    def __init__(self, head: str) -> None:
        super().__init__()
        self.head = head
        self.add_state("correct", torch.zeros((), dtype=torch.long))
        self.add_state("total", torch.zeros((), dtype=torch.long))

    def update(self, out: Any, batch: Mapping[str, Any]) -> None:
        logits = out.outputs[self.head].detach()  # (B, C)
        target = batch["labels"].to(logits.device)
        if target.ndim == 2:
            target = target.argmax(-1)
        self.correct += (logits.argmax(-1) == target).sum().to(self.correct.device)
        self.total += target.numel()

    def keys(self) -> list[str]:
        return [f"top1_{self.head}"]

    def compute(self) -> dict[str, float]:
        total = int(self.total.item())
        return {f"top1_{self.head}": int(self.correct.item()) / total if total else float("nan")}
