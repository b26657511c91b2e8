"""The gradient arithmetic of one optimizer update: summing micro-batch outputs on the
device and over processes, the one host sync, normalising and clipping in one multiply,
and finding the first non-finite gradient. ``Trainer.train_step`` runs these stages in order.

Gradient accumulation is exact: a task's loss is *summed* over its items and the
accumulated gradient is divided once by the item count of all micro-batches (and
processes), so ``grad_accum=4, batch_size=8`` updates the weights exactly as
``grad_accum=1, batch_size=32`` does (fairseq's ``sample_size`` normalisation).

Gradient clipping: https://arxiv.org/abs/1211.5063
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Sequence

import torch
from torch.distributed.tensor import DTensor

from tk.core.distributed import all_reduce_sum, float64_vector
from tk.core.step import StepOutput

__all__ = ["UpdateSums", "Synced", "local_tensors", "grad_norms", "sync_to_host", "normalise_and_clip_", "first_non_finite", "UpdateResult",
           "apply_update", "step_or_skip"]


class UpdateSums:
    """The loss, item count and task logs of one update, summed over its micro-batches.

    Tensors stay on the device (no host sync per micro-batch); the first micro-batch's
    values are taken as they are, so a one-micro-batch update adds no tensor ops.
    """

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None
        self.items: float | torch.Tensor | None = None
        self.logs: dict[str, Any] = {}

    def add(self, out: StepOutput) -> None:
        """Add one micro-batch's :class:`StepOutput` (its loss detached)."""
        loss = out.loss.detach()
        if self.loss is None:
            self.loss, self.items = loss, out.num_items
        else:
            self.loss, self.items = self.loss + loss, self.items + out.num_items
        for key, value in out.logs.items():
            value = value.detach() if torch.is_tensor(value) else float(value)
            self.logs[key] = self.logs[key] + value if key in self.logs else value

    def all_reduce(self, stop: float, world_size: int, device: torch.device
                   ) -> tuple[torch.Tensor, Any, Any, dict[str, Any]]:
        """The loss, items, ``stop`` ("this process got a signal") and the logs (sorted by
        key, the same keys on every process), summed over processes in one all-reduce
        (one process: as they are)."""
        if world_size == 1:
            return self.loss, self.items, stop, self.logs
        keys = sorted(self.logs)
        stats = float64_vector([self.loss, self.items, stop, *(self.logs[k] for k in keys)], device)
        all_reduce_sum(stats)
        loss, items, stop, *values = stats.unbind()
        return loss, items, stop, dict(zip(keys, values))


class Synced(NamedTuple):
    """Host copies of an update's numbers, read in one sync."""

    loss: float  # the loss given
    scale: float  # the gradient multiplier given
    grad_norm: float  # global norm of grads * scale (fp16's loss scale already removed)
    numbers: list[float]  # the numbers given, in order


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This process's part of each tensor: the local shard of a DTensor (FSDP2's sharded
    gradients; in-place ops on it change the DTensor), the tensor itself otherwise."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def grad_norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms of ``grads``, whose ``hypot`` is the global norm. Sharded
    (DTensor) gradients give one norm: that of all shards of all processes (their squared
    local norms all-reduced on the device, no host sync), so clipping sees the full model's."""
    if not grads:
        return []
    if not any(isinstance(g, DTensor) for g in grads):
        return list(torch._foreach_norm(list(grads)))
    squares = torch.stack(torch._foreach_norm(local_tensors(grads))).double().square().sum()
    return [all_reduce_sum(squares).sqrt()]


def sync_to_host(loss: torch.Tensor, grads: Sequence[torch.Tensor], scale: float | torch.Tensor,
                 numbers: Sequence[float | torch.Tensor] = ()) -> Synced:
    """Bring the loss, ``scale``, ``numbers`` and the per-tensor gradient norms to the
    host in one sync (``.tolist()`` of one stacked vector); the global norm is then host
    arithmetic.

    Args:
        loss: 0-dim tensor.
        grads: the (unscaled) gradients.
        scale: the gradient multiplier, a float or a 0-dim tensor.
        numbers: floats (passed through) or 0-dim tensors (integer ones are read as
            float64, so counts stay exact), e.g. the item count and the task's logs.
    """
    tensors = [v if v.is_floating_point() else v.double() for v in numbers if torch.is_tensor(v)]
    synced = [loss, *tensors, scale] if torch.is_tensor(scale) else [loss, *tensors]
    synced = [t if t.device == loss.device else t.to(loss.device) for t in synced]  # e.g. a CPU item count
    host = torch.stack([*synced, *grad_norms(grads)]).tolist()  # the one host sync
    head = len(synced)
    scale = host[head - 1] if torch.is_tensor(scale) else scale
    values = iter(host[1:1 + len(tensors)])
    return Synced(host[0], scale, scale * math.hypot(*host[head:]),
                  [next(values) if torch.is_tensor(v) else v for v in numbers])


def normalise_and_clip_(grads: Sequence[torch.Tensor], scale: float, grad_norm: float,
                        max_norm: float | None) -> None:
    """Multiply ``grads`` by ``scale`` and clip their global norm to ``max_norm`` as
    ``torch.nn.utils.clip_grad_norm_`` does, in one in-place multiply (none when the
    factor is 1). A non-finite norm changes nothing, so the bad gradient stays findable.

    Args:
        grads: the gradients.
        scale: e.g. ``world_size / items`` (1.0: normalised already).
        grad_norm: the global norm of ``grads * scale`` (from :func:`sync_to_host`).
        max_norm: the clipping threshold (None: no clipping).
    """
    if not math.isfinite(grad_norm):
        return
    factor = scale if max_norm is None else scale * min(1.0, max_norm / (grad_norm + 1e-6))
    if factor != 1.0 and grads:
        torch._foreach_mul_(local_tensors(grads), factor)


def first_non_finite(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """The name of the first parameter whose gradient holds an inf/NaN (None: none does)."""
    return next((name for name, p in named_params
                 if p.grad is not None and not torch.isfinite(local_tensors([p.grad])[0]).all()), None)


class UpdateResult(NamedTuple):
    """What :func:`apply_update` did, with host copies of its numbers."""

    took_step: bool  # the optimizer step was applied
    skipped_because: str | None  # None, "overflow" (fp16: inf gradients from a finite loss; the
    # scaler lowers its scale, expected now and then) or "non-finite" (loss or gradients NaN/inf)
    loss: float  # the ``loss`` given, on the host
    grad_norm: float  # global norm of grads * scale before clipping (fp16's loss scale removed)
    extras: list[float]  # the ``extras`` given, on the host


def step_or_skip(optimizer: torch.optim.Optimizer, scaler: Any, host: Synced) -> str | None:
    """``optimizer.step()``, unless the loss or (without a GradScaler) the gradient norm is
    inf/NaN; with fp16's GradScaler (``scaler``), its step skips an overflow itself and the
    loss scale is adjusted after it (halved after an overflow, grown after a run of good steps).

    Returns:
        None when the step was taken, else why not: ``"non-finite"`` or ``"overflow"``.
    """
    if not math.isfinite(host.loss) or (scaler is None and not math.isfinite(host.grad_norm)):
        why = "non-finite"
        if scaler is not None:
            scaler.skip(optimizer)
    elif scaler is not None:
        why = None if scaler.step(optimizer) else "overflow"
    else:
        optimizer.step()
        why = None
    if scaler is not None:
        scaler.update()
    return why


def apply_update(precision: Any, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], loss: torch.Tensor,
                 *, scale: float | torch.Tensor = 1.0, max_norm: float | None = None,
                 extras: Sequence[torch.Tensor] = ()) -> UpdateResult:
    """The update stages of ``Trainer.train_step`` as one call, for hand-written loops:
    unscale (fp16) -> one host sync -> scale and clip -> step unless the loss or the
    gradients are inf/NaN (fp16: the GradScaler skips overflows) -> adjust the loss scale.

    Args:
        precision: the run's ``Precision`` (its GradScaler, if any).
        optimizer: the optimizer over ``grads``' parameters.
        grads: the (accumulated) gradients.
        loss: 0-dim tensor, the loss the gradients came from (its finiteness is checked).
        scale: gradient multiplier, e.g. ``world_size / items``; a 0-dim tensor is read in the same sync.
        max_norm: clip the global norm of the scaled gradients to it (None: no clipping).
        extras: 0-dim tensors to bring to the host in the same sync.
    """
    precision.unscale_(optimizer)
    host = sync_to_host(loss, grads, scale, extras)
    normalise_and_clip_(grads, host.scale, host.grad_norm, max_norm)
    why = step_or_skip(optimizer, precision.scaling, host)
    return UpdateResult(why is None, why, host.loss, host.grad_norm, host.numbers)
