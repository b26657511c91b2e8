"""Metrics shared by the text tasks: perplexity, the single-label classification report
(top-1, macro-F1, per-class table, confusion matrix) and multi-label micro/macro-F1.

All merge exactly across processes (sufficient statistics in ``add_state``, see
:class:`tk.core.metrics.Metric`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tk.core.metrics import Metric
from tk.core.step import EvalContext, StepOutput
from tk.core.text.confusion import save_confusion_png

__all__ = ["ClassificationMetrics", "MultiLabelMetrics", "Perplexity"]

_PER_CLASS = ["class", "support", "predicted", "precision", "recall", "f1"]


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


class Perplexity(Metric):
    """``exp`` of the mean per-token loss over the whole evaluation: ``exp(sum loss / sum tokens)``,
    with ``out.loss`` the batch's summed token loss (nats, no label smoothing) and
    ``out.num_items`` its token count. Subclass and extend :meth:`keys`/:meth:`compute` for
    more views of the same sums (e.g. bits per token = :meth:`mean_loss` / ln 2).

    Args:
        key: the result key.
    """

    def __init__(self, key: str = "perplexity") -> None:
        super().__init__()
        self.key = key
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64))
        self.add_state("tokens", torch.zeros((), dtype=torch.float64))

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        self.loss_sum += out.loss.detach().to(self.loss_sum.device, torch.float64)
        self.tokens += torch.as_tensor(out.num_items).to(self.tokens.device, torch.float64)

    def mean_loss(self) -> float:
        """Nats per token (NaN before any token)."""
        tokens = float(self.tokens)
        return float(self.loss_sum) / tokens if tokens else float("nan")

    def keys(self) -> list[str]:
        return [self.key]

    def compute(self) -> dict[str, float]:
        nats = self.mean_loss()
        return {self.key: float("inf") if nats > 700 else math.exp(nats)}  # math.exp overflows past ~709


class ClassificationMetrics(Metric):
    """Single-label classification report from the (true, predicted) counts.

    ``compute`` returns ``{"top1", "macro_f1"}``: top-1 accuracy, and the unweighted mean over
    classes of ``2 tp / (2 tp + fp + fn)`` over the classes that occur as a target or a
    prediction (sklearn's ``f1_score(average="macro")`` up to classes absent from both).
    ``write`` puts into ``out_dir``: ``{prefix}_per_class.tsv`` (class, support, predicted,
    precision, recall, f1), ``{prefix}_confusion.tsv`` (rows true, columns predicted, counts)
    and ``{prefix}_confusion.png``.

    Args:
        class_names: the C class names in index order; ``out.outputs`` is logits (B, C),
            ``batch["labels"]`` (B,) class indices.
    """

    def __init__(self, class_names: Sequence[str]) -> None:
        super().__init__()
        self.class_names = [str(c) for c in class_names]
        C = len(self.class_names)
        self.add_state("matrix", torch.zeros(C, C, dtype=torch.long))  # rows: true, cols: predicted

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        logits = out.outputs.detach()
        target = batch["labels"].to(logits.device)
        C = len(self.class_names)
        pairs = torch.bincount(target * C + logits.argmax(-1), minlength=C * C).view(C, C)
        self.matrix += pairs.to(self.matrix.device)

    def keys(self) -> list[str]:
        return ["top1", "macro_f1"]

    def compute(self) -> dict[str, float]:
        m = self.matrix.double().cpu()
        total = m.sum().item()
        tp = m.diagonal()
        fp, fn = m.sum(0) - tp, m.sum(1) - tp
        present = (tp + fp + fn) > 0
        return {"top1": tp.sum().item() / total if total else float("nan"),
                "macro_f1": _f1(tp, fp, fn)[present].mean().item() if present.any() else float("nan")}

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
        _write_table(out_dir / f"{prefix}_per_class.tsv", _PER_CLASS, self.per_class())
        m = self.matrix.cpu()
        _write_table(out_dir / f"{prefix}_confusion.tsv", ["true\\predicted", *self.class_names],
                     [[name, *row] for name, row in zip(self.class_names, m.tolist())])
        save_confusion_png(m, self.class_names, str(out_dir / f"{prefix}_confusion.png"))


class MultiLabelMetrics(Metric):
    """Multi-label: per-class true/false positives and false negatives of ``sigmoid(logit) > threshold``.

    ``compute`` returns ``{"micro_f1", "macro_f1", "subset_acc"}``: micro-F1 from the counts
    summed over classes, macro-F1 the mean of per-class F1 over the classes that occur as a
    target or a prediction (sklearn's ``f1_score(average="micro"/"macro")`` up to classes
    absent from both), subset_acc the share of examples whose whole label set is right
    (sklearn's ``accuracy_score`` on multi-label input; not top-1).
    ``write`` puts ``{prefix}_per_class.tsv`` (class, support, predicted, precision, recall,
    f1) into ``out_dir``.

    Args:
        class_names: the C label names; ``out.outputs`` is logits (B, C), ``batch["labels"]`` (B, C) 0/1.
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

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        logits = out.outputs.detach()
        pred = logits.float().sigmoid() > self.threshold
        target = batch["labels"].to(logits.device) > 0.5
        self.tp += (pred & target).sum(0).to(self.tp.device)
        self.fp += (pred & ~target).sum(0).to(self.fp.device)
        self.fn += (~pred & target).sum(0).to(self.fn.device)
        self.exact += (pred == target).all(-1).sum().to(self.exact.device)
        self.total += target.shape[0]

    def keys(self) -> list[str]:
        return ["micro_f1", "macro_f1", "subset_acc"]

    def compute(self) -> dict[str, float]:
        tp, fp, fn = (t.double().cpu() for t in (self.tp, self.fp, self.fn))
        present = (tp + fp + fn) > 0
        total = int(self.total.item())
        return {"micro_f1": _f1(tp.sum(), fp.sum(), fn.sum()).item() if present.any() else float("nan"),
                "macro_f1": _f1(tp, fp, fn)[present].mean().item() if present.any() else float("nan"),
                "subset_acc": int(self.exact.item()) / total if total else float("nan")}

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
        _write_table(out_dir / f"{ctx.key_prefix}_per_class.tsv", _PER_CLASS, self.per_class())
