"""The classifier's evaluation metrics, from :mod:`tk.core.text`: top-1 accuracy, macro-F1,
per-class table and confusion matrix (single-label); micro/macro-F1 and subset accuracy
(multi-label)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tk.core.metrics import Metric
from tk.core.text import ClassificationMetrics, MultiLabelMetrics


def build_metrics(labels: Sequence[Any], multi_label: bool, threshold: float) -> dict[str, Metric]:
    """``{"cls": metric}``: keys ``top1``, ``macro_f1``; multi-label ``micro_f1``, ``macro_f1``,
    ``subset_acc`` (a label is predicted where its sigmoid exceeds ``threshold``)."""
    if multi_label:
        return {"cls": MultiLabelMetrics(labels, threshold)}
    return {"cls": ClassificationMetrics(labels)}
