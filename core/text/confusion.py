"""The confusion matrix as a PNG (matplotlib, Agg canvas), shared by the classification
plugins (text and image); a small matrix gets the counts written into its cells."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["save_confusion_png"]

_ANNOTATE_MAX = 12  # classes up to which each cell shows its count


def save_confusion_png(matrix: torch.Tensor, class_names: Sequence[str], path: str, noun: str = "examples") -> None:
    """Row-normalised (C, C) confusion matrix (rows true, columns predicted) as a heat map.

    Args:
        matrix: (C, C) counts.
        class_names: the C names, in index order.
        path: the PNG to write.
        noun: what the title counts ("examples", "images").
    """
    # Figure + FigureCanvasAgg directly: no pyplot, so no global backend switch or GUI
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only evaluation writes plots
    from matplotlib.figure import Figure

    C = matrix.shape[0]
    rates = matrix.double() / matrix.sum(1, keepdim=True).clamp(min=1)
    side = min(4 + 0.35 * C, 24)
    fig = Figure(figsize=(side, side * 0.85))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(rates.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if C <= 30:  # beyond that, names overlap: leave index ticks
        ax.set_xticks(range(C), [str(c) for c in class_names], rotation=90, fontsize=8)
        ax.set_yticks(range(C), [str(c) for c in class_names], fontsize=8)
    if C <= _ANNOTATE_MAX:
        for i in range(C):
            for j in range(C):
                ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=8,
                        color="white" if rates[i, j] > 0.5 else "black")
    ax.set_title(f"confusion matrix (row-normalised), {int(matrix.sum())} {noun}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
