"""Classifier metrics: accuracy, macro-F1, per-class precision/recall and the confusion matrix
(single-label), micro/macro-F1 (multi-label); tables and a PNG written after evaluation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tk.core.text.confusion import save_confusion_png
from tk.core.metrics import Metric
from tk.core.step import EvalContext


def _f1(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """Per-class ``2 tp / (2 tp + fp + fn)`` (0 where the class never occurs nor is predicted)."""
    return 2 * tp / (2 * tp + fp + fn).clamp(min=1)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """``a / b`` per class, NaN where ``b`` is 0 (precision of a never-predicted class)."""
    return [x / y if y else float("nan") for x, y in zip(a.tolist(), b.tolist())]


def _write_table(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def cell(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    with open(path, "w", encoding="utf-8") as f:
        f.write("\t".join(header) + "\n")
        f.writelines("\t".join(cell(v) for v in row) + "\n" for row in rows)


class ClassificationMetrics(Metric):
    """Single-label: counts (true, predicted) pairs; ``compute`` returns ``{"accuracy", "macro_f1"}``.

    Macro-F1 is the unweighted mean over classes of ``2 tp / (2 tp + fp + fn)``, over the
    classes that occur as a target or a prediction (sklearn's ``f1_score(average="macro")``
    up to classes absent from both). ``write`` puts into ``out_dir``:
    ``{prefix}_per_class.tsv`` (class, support, predicted, precision, recall, f1),
    ``{prefix}_confusion.tsv`` (rows true, columns predicted, counts) and
    ``{prefix}_confusion.png``.

    Args:
        class_names: the C class names in index order; logits are (B, C), ``batch["labels"]``
            (B,) class indices.
    """

    def __init__(self, class_names: Sequence[str]) -> None:
        super().__init__()
        self.class_names = [str(c) for c in class_names]
        C = len(self.class_names)
        self.add_state("matrix", torch.zeros(C, C, dtype=torch.long))  # rows: true, cols: predicted

    def update(self, out: Any, batch: Mapping[str, Any]) -> None:
        logits = out.outputs.detach()
        target = batch["labels"].to(logits.device)
        C = len(self.class_names)
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
        f1 = _f1(tp, fp, fn)[present]
        return {"accuracy": tp.sum().item() / total if total else float("nan"),
                "macro_f1": f1.mean().item() if present.any() else float("nan")}

    def per_class(self) -> list[tuple[str, int, int, float, float, float]]:
        """Rows ``(class, support, predicted, precision, recall, f1)``; precision (recall) is NaN
        for a class never predicted (never true)."""
        m = self.matrix.cpu()
        tp, support, predicted = m.diagonal(), m.sum(1), m.sum(0)
        f1 = _f1(tp.double(), (predicted - tp).double(), (support - tp).double()).tolist()
        return list(zip(self.class_names, support.tolist(), predicted.tolist(), _ratio(tp, predicted),
                        _ratio(tp, support), f1))

    def write(self, out_dir: Path, ctx: EvalContext) -> None:
        """Write the per-class table, the confusion matrix (TSV) and its PNG into ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        prefix = ctx.key_prefix
        _write_table(out_dir / f"{prefix}_per_class.tsv", ["class", "support", "predicted", "precision", "recall", "f1"],
                     self.per_class())
        m = self.matrix.cpu()
        _write_table(out_dir / f"{prefix}_confusion.tsv", ["true\\predicted", *self.class_names],
                     [[name, *row] for name, row in zip(self.class_names, m.tolist())])
        save_confusion_png(m, self.class_names, str(out_dir / f"{prefix}_confusion.png"))


class MultiLabelMetrics(Metric):
    """Multi-label: per-class true/false positives and false negatives of ``sigmoid(logit) > threshold``.

    ``compute`` returns ``{"micro_f1", "macro_f1", "accuracy"}``: micro-F1 from the counts
    summed over classes, macro-F1 the mean of per-class F1 over the classes that occur as a
    target or a prediction (sklearn's ``f1_score(average="micro"/"macro")`` up to classes
    absent from both), accuracy the share of examples whose whole label set is right (subset
    accuracy, as sklearn's ``accuracy_score`` on multi-label input).
    ``write`` puts ``{prefix}_per_class.tsv`` (class, support, predicted, precision, recall,
    f1) into ``out_dir``.

    Args:
        class_names: the C label names; logits are (B, C), ``batch["labels"]`` (B, C) 0/1.
        threshold: probability above which a label is predicted.
    """

    def __init__(self, class_names: Sequence[str], threshold: float = 0.5) -> None:
        super().__init__()
        self.class_names = [str(c) for c in class_names]
        self.threshold = threshold
        C = len(self.class_names)
        for name in ("tp", "fp", "fn"):
            self.add_state(name, torch.zeros(C, dtype=torch.long))
        self.add_state("exact", torch.zeros((), dtype=torch.long))
        self.add_state("total", torch.zeros((), dtype=torch.long))

    def update(self, out: Any, batch: Mapping[str, Any]) -> None:
        logits = out.outputs.detach()
        pred = logits.float().sigmoid() > self.threshold
        target = batch["labels"].to(logits.device) > 0.5
        self.tp += (pred & target).sum(0).to(self.tp.device)
        self.fp += (pred & ~target).sum(0).to(self.fp.device)
        self.fn += (~pred & target).sum(0).to(self.fn.device)
        self.exact += (pred == target).all(-1).sum().to(self.exact.device)
        self.total += target.shape[0]

    def keys(self) -> list[str]:
        return ["micro_f1", "macro_f1", "accuracy"]

    def compute(self) -> dict[str, float]:
        tp, fp, fn = (t.double().cpu() for t in (self.tp, self.fp, self.fn))
        present = (tp + fp + fn) > 0
        total = int(self.total.item())
        return {"micro_f1": _f1(tp.sum(), fp.sum(), fn.sum()).item() if present.any() else float("nan"),
                "macro_f1": _f1(tp, fp, fn)[present].mean().item() if present.any() else float("nan"),
                "accuracy": int(self.exact.item()) / total if total else float("nan")}

    def per_class(self) -> list[tuple[str, int, int, float, float, float]]:
        """Rows ``(class, support, predicted, precision, recall, f1)``."""
        tp, fp, fn = (t.cpu() for t in (self.tp, self.fp, self.fn))
        support, predicted = tp + fn, tp + fp
        f1 = _f1(tp.double(), fp.double(), fn.double()).tolist()
        return list(zip(self.class_names, support.tolist(), predicted.tolist(), _ratio(tp, predicted),
                        _ratio(tp, support), f1))

    def write(self, out_dir: Path, ctx: EvalContext) -> None:
        """Write the per-class table into ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_table(out_dir / f"{ctx.key_prefix}_per_class.tsv",
                     ["class", "support", "predicted", "precision", "recall", "f1"], self.per_class())
