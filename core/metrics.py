"""Evaluation metrics whose tensor states merge exactly across processes.

A metric accumulates sufficient statistics per batch (``update``), merges them across
processes once (``sync``) and turns them into numbers (``compute``), in the spirit of
torchmetrics (https://lightning.ai/docs/torchmetrics).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from tk.core.engine.distributed import comm_device, is_distributed
from tk.core.errors import TkError
from tk.core.step import StepOutput

__all__ = ["Metric", "Accuracy", "Mean", "MetricCollection"]

Reduce = Literal["sum", "max", "min", "cat"]
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class Metric:
    """Base class: declare states with :meth:`add_state` in ``__init__`` and implement
    :meth:`update` and :meth:`compute`.

    States are tensors. ``"sum"``/``"max"``/``"min"`` states are reduced element-wise
    across processes; ``"cat"`` states are concatenated along dim 0 (grow them with
    :meth:`append`). Call :meth:`sync` once after the last ``update`` and before
    ``compute``; it is a no-op outside a multi-process group and when already synced.
    """

    def __init__(self) -> None:
        self._defaults: dict[str, torch.Tensor] = {}
        self._reductions: dict[str, Reduce] = {}
        self._synced = False
        self.device = torch.device("cpu")

    def add_state(self, name: str, default: torch.Tensor, reduce: Reduce = "sum") -> None:
        """Declare a state ``self.<name>`` that starts as a copy of ``default``.

        Raises:
            ValueError: unknown ``reduce`` or a non-tensor default.
        """
        if reduce not in ("sum", "max", "min", "cat"):
            raise ValueError(f"reduce must be 'sum', 'max', 'min' or 'cat', got {reduce!r}")
        if not isinstance(default, torch.Tensor):
            raise ValueError(f"state {name!r}: default must be a tensor, got {type(default).__name__}")
        self._defaults[name] = default.detach().clone()
        self._reductions[name] = reduce
        setattr(self, name, default.detach().clone().to(self.device))

    def append(self, name: str, value: torch.Tensor) -> None:
        """Concatenate ``value`` (dim 0) onto the ``"cat"`` state ``name``."""
        state = getattr(self, name)
        setattr(self, name, torch.cat([state, value.detach().to(state.device, state.dtype)]))

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        """Accumulate one batch. ``out`` is what ``Task.eval_step`` returned."""
        raise NotImplementedError(f"{type(self).__name__} must implement update")

    def compute(self) -> dict[str, float]:
        """The metric values from the (synced) states."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute")

    def reset(self) -> None:
        """Put every state back to its default."""
        for name, default in self._defaults.items():
            setattr(self, name, default.clone().to(self.device))
        self._synced = False

    def to(self, device: torch.device | str) -> Metric:
        """Move the states to ``device`` (where ``update`` receives its tensors)."""
        self.device = torch.device(device)
        for name in self._defaults:
            setattr(self, name, getattr(self, name).to(self.device))
        return self

    def sync(self) -> None:
        """Merge the states of all processes (all-reduce / all-gather), in place.

        Every process must call it, in the same order for every metric. States travel
        on the backend's device (the current GPU for NCCL, CPU for gloo) and come back
        to ``self.device``.
        """
        if self._synced or not is_distributed():
            return
        dev = comm_device()
        for name, reduce in self._reductions.items():
            local = getattr(self, name).to(dev)
            if reduce == "cat":
                merged = _all_gather_cat(local)
            else:
                merged = local.clone()
                dist.all_reduce(merged, op=getattr(dist.ReduceOp, _OPS[reduce]))
            setattr(self, name, merged.to(self.device))
        self._synced = True


def _all_gather_cat(local: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors of different lengths (dim 0) from all processes, rank order."""
    world = dist.get_world_size()
    n = torch.tensor([local.shape[0]], device=local.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    longest = max(sizes)
    # all_gather needs equal shapes: pad to the longest, trim after.
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    raise TypeError(
        "Accuracy expects StepOutput.outputs to be a logits tensor (..., C) or a dict with "
        f"'logits', got {type(outputs).__name__}"
    )


class Accuracy(Metric):
    """Top-k accuracy of logits ``(..., C)`` against integer targets ``(...)``.

    Works per sample (``(B, C)`` vs ``(B,)``) and per token (``(B, T, C)`` vs ``(B, T)``).
    Soft targets ``(..., C)`` (float, e.g. after Mixup) count their argmax as the label.
    ``compute`` returns fractions in [0, 1]: ``{"top1": ..., "top5": ...}`` (NaN when no
    item was seen).

    Args:
        topk: the k values; k larger than C counts as C.
        target_key: batch key holding the targets.
        ignore_index: target value to leave out (e.g. the PAD id).
    """

    def __init__(self, topk: Sequence[int] = (1,), target_key: str = "labels", ignore_index: int | None = None) -> None:
        super().__init__()
        if not topk or any(int(k) < 1 for k in topk):
            raise ValueError(f"topk must be a non-empty list of integers >= 1, got {tuple(topk)}")
        self.topk = tuple(int(k) for k in topk)
        self.target_key = target_key
        self.ignore_index = ignore_index
        self.add_state("correct", torch.zeros(len(self.topk), dtype=torch.long))
        self.add_state("total", torch.zeros((), dtype=torch.long))

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        logits = _logits(out.outputs).detach()
        if self.target_key not in batch:
            raise TkError(f"Accuracy: the batch has no {self.target_key!r} (keys: {sorted(batch)}); set target_key")
        target = batch[self.target_key].to(logits.device)
        if target.is_floating_point() and target.shape == logits.shape:
            target = target.argmax(-1)
        num_classes = logits.shape[-1]
        logits = logits.reshape(-1, num_classes)  # (N, C)
        target = target.reshape(-1)  # (N,)
        if logits.shape[0] != target.shape[0]:
            raise ValueError(f"Accuracy: logits {tuple(logits.shape)} do not match {len(target)} targets")
        if self.ignore_index is not None:
            keep = target != self.ignore_index
            logits, target = logits[keep], target[keep]
        maxk = min(max(self.topk), num_classes)
        hits = logits.topk(maxk, dim=-1).indices.eq(target[:, None])  # (N, maxk)
        correct = torch.stack([hits[:, : min(k, num_classes)].any(-1).sum() for k in self.topk])
        self.correct += correct.to(self.correct.device)
        self.total += target.numel()

    def compute(self) -> dict[str, float]:
        total = int(self.total.item())
        return {
            f"top{k}": (int(c) / total if total else float("nan"))
            for k, c in zip(self.topk, self.correct.tolist())
        }


class Mean(Metric):
    """Per-item average of a summed value: ``sum(out.logs[key]) / sum(out.num_items)``.

    ``key="loss"`` falls back to ``out.loss`` when ``logs`` has no ``"loss"``.

    Args:
        name: the key ``compute`` returns.
        key: the ``StepOutput.logs`` key (already summed over the batch's items).
    """

    def __init__(self, name: str, key: str) -> None:
        super().__init__()
        self.name, self.key = name, key
        self.add_state("sum", torch.zeros((), dtype=torch.float64))
        self.add_state("count", torch.zeros((), dtype=torch.float64))

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        if self.key in out.logs:
            value = out.logs[self.key]
        elif self.key == "loss":
            value = out.loss
        else:
            raise TkError(f"Mean({self.name!r}): StepOutput.logs has no {self.key!r} (keys: {sorted(out.logs)})")
        self.sum += torch.as_tensor(value).detach().to(self.sum.device, torch.float64)
        self.count += torch.as_tensor(out.num_items).detach().to(self.count.device, torch.float64)

    def compute(self) -> dict[str, float]:
        count = float(self.count)
        return {self.name: float(self.sum) / count if count else float("nan")}


class MetricCollection:
    """Update, sync and compute a dict of metrics at once; results get ``prefix``.

    ``MetricCollection({"acc": Accuracy((1, 5))}, prefix="val/").compute()`` returns
    ``{"val/top1": ..., "val/top5": ...}``.

    Raises:
        ValueError (from ``compute``): two metrics return the same result name.
    """

    def __init__(self, metrics: Mapping[str, Metric], prefix: str = "") -> None:
        self.metrics = dict(metrics)
        self.prefix = prefix

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        for metric in self.metrics.values():
            metric.update(out, batch)

    def sync(self) -> None:
        for name in sorted(self.metrics):  # same order on every process
            self.metrics[name].sync()

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def to(self, device: torch.device | str) -> MetricCollection:
        for metric in self.metrics.values():
            metric.to(device)
        return self

    def compute(self) -> dict[str, float]:
        results: dict[str, float] = {}
        owner: dict[str, str] = {}
        for name, metric in self.metrics.items():
            for key, value in metric.compute().items():
                full = self.prefix + key
                if full in results:
                    raise ValueError(f"metrics {owner[full]!r} and {name!r} both return {full!r}; rename one")
                results[full], owner[full] = value, name
        return results
