"""Evaluation over one split: the task's loss and metrics, merged across processes."""

from __future__ import annotations

import torch
from torch import nn

from tk.core.engine.device import move_to_device
from tk.core.engine.distributed import all_reduce_sum

__all__ = ["evaluate_loader"]


@torch.no_grad()
def evaluate_loader(task, model: nn.Module, loader, device: torch.device, precision, split: str,
                    prefix: str | None = None) -> dict[str, float]:
    """Loss and the task's metrics over ``loader``, merged across processes.

    Args:
        task: the task (``eval_step``, ``build_metrics``, ``transform_batch``).
        model: the model to evaluate (put in eval mode for the pass, then restored).
        loader: batches of the split (sharded per process when distributed).
        device: where the model is.
        precision: a ``tk.core.engine.precision.Precision`` (autocast).
        split: the split name given to ``build_metrics``.
        prefix: key prefix of the results (default ``split``), e.g. ``"val_ema"``.

    Returns:
        ``{"<prefix>/loss": ..., "<prefix>/<metric>": ...}``; the loss is per item.
    """
    prefix = prefix or split
    was_training = model.training
    model.eval()
    metrics = task.build_metrics(split)
    for m in metrics.values():
        m.to(device)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = move_to_device(batch, device)
        with precision.autocast():
            batch = task.transform_batch(batch, training=False)
            out = task.eval_step(model, batch)
        totals[0] += out.loss.detach().double()
        totals[1] += out.num_items
        for m in metrics.values():
            m.update(out, batch)
    all_reduce_sum(totals)
    results = {f"{prefix}/loss": float(totals[0] / totals[1].clamp(min=1))}
    for name in sorted(metrics):  # same order on every process: sync is a collective
        metrics[name].sync()
        results.update({f"{prefix}/{k}": float(v) for k, v in metrics[name].compute().items()})
    model.train(was_training)
    return results
