"""Evaluation over one split: the task's loss and metrics, merged across processes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tk.core.distributed import all_reduce_sum, is_main_process
from tk.core.metrics import MetricCollection
from tk.core.step import EvalContext
from tk.core.training.device import move_to_device

__all__ = ["evaluate_loader", "metric_keys"]


def metric_keys(task, ctx: EvalContext) -> list[str]:
    """The result keys an evaluation in ``ctx`` will return (``<prefix>/loss`` first),
    from the metrics' declared keys: known before any data is read.

    Raises:
        TkError: two metrics declare the same key.
    """
    prefix = ctx.key_prefix + "/"
    return [prefix + "loss"] + MetricCollection(task.build_metrics(ctx), prefix).keys()


@torch.no_grad()
def evaluate_loader(task, model: nn.Module, loader, device: torch.device, precision, ctx: EvalContext,
                    out_dir: Path | None = None, media: Callable[[list], None] | None = None) -> dict[str, float]:
    """Loss and the task's metrics over ``loader``, merged across processes.

    Args:
        task: the task (``eval_step``, ``build_metrics``, ``transform_batch``).
        model: the model to evaluate (put in eval mode for the pass, then restored).
        loader: batches of the split (sharded per process when distributed).
        device: where the model is.
        precision: a ``tk.core.training.precision.Precision`` (autocast).
        ctx: which evaluation this is (split, step, periodic/final/stand-alone, prefix).
        out_dir: where metrics may write files (rank 0 only); None writes nothing.
        media: receives the images/text of the metrics that define ``media(ctx)``
            (``tk.core.media``), on rank 0; None: none are made.

    Returns:
        ``{"<prefix>/loss": ..., "<prefix>/<metric key>": ...}``; the loss is per item.
    """
    prefix = ctx.key_prefix + "/"
    was_training = model.training
    model.eval()
    metrics = MetricCollection(task.build_metrics(ctx), prefix).to(device)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = move_to_device(batch, device)
        with precision.autocast():
            batch = task.transform_batch(batch, training=False)
            out = task.eval_step(model, batch, ctx)
        totals[0] += out.loss.detach().double()
        totals[1] += out.num_items
        metrics.update(out, batch)
    all_reduce_sum(totals)
    results = {prefix + "loss": float(totals[0] / totals[1].clamp(min=1))}
    metrics.sync()
    results.update({k: float(v) for k, v in metrics.compute().items()})
    if out_dir is not None and is_main_process():
        try:
            metrics.write(out_dir, ctx)
        except OSError as e:  # a read-only or full run dir must not cost the computed metrics
            warnings.warn(f"could not write the evaluation files into {out_dir}: {e}", stacklevel=2)
    if media is not None and is_main_process():
        try:
            items = [item for metric in metrics.metrics.values() if callable(getattr(metric, "media", None))
                     for item in metric.media(ctx)]
        except Exception as e:  # samples are for people to look at: a broken one must not cost the run
            warnings.warn(f"could not build the evaluation's media: {e}", stacklevel=2)
            items = []
        media(items)
    model.train(was_training)
    return results
