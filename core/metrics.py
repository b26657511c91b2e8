"""Evaluation metrics whose states merge exactly across processes.

A metric declares its result keys (``keys``), accumulates sufficient statistics per
batch (``update``), merges them across processes once (``sync``), turns them into
numbers (``compute``) and may write files (``write``, on rank 0 only), in the spirit of
torchmetrics (https://lightning.ai/docs/torchmetrics).
"""

from __future__ import annotations

import warnings

from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from tk.core.distributed import comm_device, is_distributed
from tk.core.errors import TkError
from tk.core.step import EvalContext, StepOutput

__all__ = ["Metric", "Accuracy", "Mean", "MetricCollection"]

Reduce = Literal["sum", "max", "min", "cat", "objects"]
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class Metric:
    """Base class: declare states with :meth:`add_state` in ``__init__`` and implement
    :meth:`keys`, :meth:`update` and :meth:`compute` (and :meth:`write` for files).

    Tensor states: ``"sum"``/``"max"``/``"min"`` are reduced element-wise across
    processes; ``"cat"`` states are concatenated along dim 0 (grow them with
    :meth:`append`). Object states (``reduce="objects"``, default ``[]``) hold Python
    objects as ``(example_id, value)`` pairs (e.g. hypothesis strings with their
    dataset index, grown with :meth:`extend`); they are gathered from every process and
    come back sorted by example id, i.e. in dataset order. Call :meth:`sync` once after
    the last ``update`` and before ``compute``; it is a no-op outside a multi-process
    group and when already synced.
    """

    def __init__(self) -> None:
        self._defaults: dict[str, torch.Tensor] = {}
        self._reductions: dict[str, Reduce] = {}
        self._synced = False
        self.device = torch.device("cpu")

    def add_state(self, name: str, default: torch.Tensor | list, reduce: Reduce = "sum") -> None:
        """Declare a state ``self.<name>`` that starts as a copy of ``default``.

        Raises:
            ValueError: unknown ``reduce``, a non-tensor default for a tensor state, or a
                non-empty-list default for an object state.
        """
        if reduce not in ("sum", "max", "min", "cat", "objects"):
            raise ValueError(f"reduce must be 'sum', 'max', 'min', 'cat' or 'objects', got {reduce!r}")
        if reduce == "objects":
            if default != []:
                raise ValueError(f"state {name!r}: an object state starts as [], got {default!r}")
        elif not isinstance(default, torch.Tensor):
            raise ValueError(f"state {name!r}: default must be a tensor, got {type(default).__name__}")
        self._defaults[name] = [] if reduce == "objects" else default.detach().clone()
        self._reductions[name] = reduce
        setattr(self, name, self._fresh(name))

    def _fresh(self, name: str) -> torch.Tensor | list:
        default = self._defaults[name]
        return [] if isinstance(default, list) else default.clone().to(self.device)

    def extend(self, name: str, items: Sequence[tuple[int, Any]]) -> None:
        """Add ``(example_id, value)`` pairs to the object state ``name``."""
        getattr(self, name).extend((int(i), v) for i, v in items)

    def keys(self) -> list[str]:
        """The result keys ``compute`` returns (without the split prefix), known before
        any data is seen, so a collision or a ``train.best_metric`` typo is found before
        training starts."""
        raise NotImplementedError(f"{type(self).__name__} must implement keys() (the names compute() returns)")

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

    def write(self, out_dir: Path, ctx: EvalContext) -> None:
        """Write files (tables, plots) after ``compute``. The engine calls it on rank 0
        only, when the run has a run dir, with ``out_dir = <run_dir>/eval``; a metric
        never needs ``torch.distributed`` for this."""

    def reset(self) -> None:
        """Put every state back to its default."""
        for name in self._defaults:
            setattr(self, name, self._fresh(name))
        self._synced = False

    def to(self, device: torch.device | str) -> Metric:
        """Move the tensor states to ``device`` (where ``update`` receives its tensors)."""
        self.device = torch.device(device)
        for name, reduce in self._reductions.items():
            if reduce != "objects":
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
            if reduce == "objects":
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, getattr(self, name))
                setattr(self, name, sorted((pair for part in gathered for pair in part), key=lambda p: p[0]))
                continue
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

    def keys(self) -> list[str]:
        return [f"top{k}" for k in self.topk]

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

    def keys(self) -> list[str]:
        return [self.name]

    def compute(self) -> dict[str, float]:
        count = float(self.count)
        return {self.name: float(self.sum) / count if count else float("nan")}


class MetricCollection:
    """Update, sync, compute and write a dict of metrics at once; results get ``prefix``.

    ``MetricCollection({"acc": Accuracy((1, 5))}, prefix="val/").compute()`` returns
    ``{"val/top1": ..., "val/top5": ...}``.

    Raises:
        TkError: two metrics declare the same result key (checked at construction,
            from ``Metric.keys()``), naming both.
    """

    def __init__(self, metrics: Mapping[str, Metric], prefix: str = "") -> None:
        self.metrics = dict(sorted(metrics.items()))  # same order on every process: sync is a collective
        self.prefix = prefix
        self.owner: dict[str, str] = {}
        for name, metric in self.metrics.items():
            for key in metric.keys():
                full = prefix + key
                if full in self.owner:
                    raise TkError(f"metrics {self.owner[full]!r} ({type(self.metrics[self.owner[full]]).__name__}) "
                                  f"and {name!r} ({type(metric).__name__}) both return {full!r}; give one of "
                                  f"them other result keys")
                self.owner[full] = name

    def keys(self) -> list[str]:
        """Every result key, prefixed, in metric order."""
        return list(self.owner)

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        for metric in self.metrics.values():
            metric.update(out, batch)

    def sync(self) -> None:
        for metric in self.metrics.values():
            metric.sync()

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def to(self, device: torch.device | str) -> MetricCollection:
        for metric in self.metrics.values():
            metric.to(device)
        return self

    def compute(self) -> dict[str, float]:
        """Every metric's results, prefixed.

        Raises:
            TkError: a metric returned a key it did not declare in ``keys()``.
        """
        results: dict[str, float] = {}
        for name, metric in self.metrics.items():
            values = metric.compute()
            undeclared = sorted(set(values) - set(metric.keys()))
            if undeclared:
                raise TkError(f"metric {name!r} ({type(metric).__name__}) returned {undeclared} but its keys() "
                              f"declare {metric.keys()}; add them to keys()")
            results.update({self.prefix + k: v for k, v in values.items()})
        return results

    def write(self, out_dir: Path, ctx: EvalContext) -> None:
        """Let every metric write its files into ``out_dir`` (created here; call on rank 0 only). A
        metric that fails to write is a warning naming it; the others still write, and the
        computed metrics are kept."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for name, metric in self.metrics.items():
            try:
                metric.write(Path(out_dir), ctx)
            except Exception as e:  # files are for people to read: a failing one must not cost the run
                warnings.warn(f"metric {name!r} ({type(metric).__name__}) could not write its files into {out_dir}: "
                              f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)
