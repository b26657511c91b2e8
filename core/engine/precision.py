"""Mixed precision: autocast contexts, fp16 loss scaling and the optimizer update
(unscale -> scale/clip -> step -> scale update) behind one small object.

Mixed precision training: https://arxiv.org/abs/1710.03740
torch.amp: https://pytorch.org/docs/stable/amp.html
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ContextManager, Mapping, NamedTuple, Sequence

import torch

from tk.core.errors import TkError

__all__ = ["Precision", "LossScaling", "UpdateResult", "check_precision"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaling:
    """A ``torch.amp.GradScaler`` plus the bookkeeping the loop needs: whether the last
    step was taken and how many were skipped for inf/NaN gradients.

    Order per update: ``backward`` (each micro-batch) -> ``unscale_`` -> clip -> ``step``
    -> ``update``.

    Args:
        scaler: the GradScaler (``torch.amp.GradScaler("cuda")`` for training; any
            device's scaler works, which lets tests run on CPU).
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.skipped_steps = 0
        self._unscaled: set[int] = set()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the scaled loss."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place (call before clipping). Idempotent
        within one update."""
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        # GradScaler records per-device inf flags when it unscales; read them if the
        # (private) layout is as expected, else check the unscaled gradients ourselves.
        try:
            flags = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            return any(bool(v.item()) for v in flags.values())
        except (AttributeError, KeyError, TypeError):
            return any(
                p.grad is not None and not torch.isfinite(p.grad).all()
                for group in optimizer.param_groups for p in group["params"]
            )

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step unless a gradient is inf/NaN.

        Returns:
            True if the step was taken, False if it was skipped.
        """
        self.unscale_(optimizer)
        skipped = self._found_inf(optimizer)
        self.scaler.step(optimizer)
        self._unscaled.discard(id(optimizer))
        self.skipped_steps += int(skipped)
        return not skipped

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Leave out this update's step (a non-finite loss with finite gradients, which
        the GradScaler would apply); ``update`` still follows."""
        self.unscale_(optimizer)
        self._unscaled.discard(id(optimizer))
        self.skipped_steps += 1

    def update(self) -> None:
        """Adjust the scale (halve after an overflow, grow after a run of good steps)."""
        self.scaler.update()

    def get_scale(self) -> float:
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def check_precision(name: str, device: torch.device | str) -> str | None:
    """Whether ``train.precision=name`` can run on ``device``: the one precision check.

    Returns:
        None when it can; else a one-line message naming ``train.precision``, the value
        and the fix (raise it as a ``TkError``).
    """
    if name not in _DTYPES:
        return f"train.precision must be one of {sorted(_DTYPES)}, got {name!r}"
    device = torch.device(device)
    if name == "fp16" and device.type != "cuda":
        return f"train.precision: fp16 needs a CUDA device (got {device.type!r}); use bf16 on CPU"
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (f"train.precision: bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                "use fp16 (loss scaling) or fp32")
    return None


class UpdateResult(NamedTuple):
    """What :meth:`Precision.apply_update` did, with host copies of its numbers."""

    took_step: bool  # the optimizer step was applied
    skipped_because: str | None  # None, "overflow" (fp16: inf gradients from a finite loss; the
    # scaler lowers its scale, expected now and then) or "non-finite" (loss or gradients NaN/inf)
    loss: float  # the ``loss`` given, on the host
    grad_norm: float  # global norm of grads * scale before clipping (fp16's loss scale removed)
    extras: list[float]  # the ``extras`` given, on the host


class Precision:
    """Numeric precision of a run: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"``
    (autocast + loss scaling, CUDA only). It owns the fp16 decisions, so the engine
    calls :meth:`backward` per micro-batch and :meth:`apply_update` per update whatever
    the precision.

    bf16 has fp32's exponent range, so it needs no scaling.

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``train.precision``).
        device: the training device.

    Raises:
        TkError: see :func:`check_precision`.
    """

    def __init__(self, precision: str, device: torch.device | str) -> None:
        problem = check_precision(precision, device)
        if problem:
            raise TkError(problem)
        self.name = precision
        self.device = torch.device(device)
        self.dtype = _DTYPES[precision]
        self.scaling: LossScaling | None = LossScaling(torch.amp.GradScaler("cuda")) if precision == "fp16" else None
        # appended to the message that stops a run after repeated non-finite steps
        self.non_finite_hint = " fp16 overflows easily: try train.precision=bf16." if precision == "fp16" else ""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (fp16 only; 0 otherwise)."""
        return self.scaling.skipped_steps if self.scaling else 0

    def autocast(self) -> ContextManager:
        """Context for the forward pass and loss (a no-op for fp32)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, on the scaled loss under fp16."""
        if self.scaling:
            self.scaling.backward(loss)
        else:
            loss.backward()

    def apply_update(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], loss: torch.Tensor, *,
                     scale: float | torch.Tensor = 1.0, max_norm: float | None = None,
                     extras: Sequence[torch.Tensor] = ()) -> UpdateResult:
        """One optimizer update: unscale (fp16) -> multiply by ``scale`` and clip the
        global norm to ``max_norm`` -> step unless the loss or gradients are inf/NaN ->
        adjust the loss scale (fp16; the GradScaler decides whether to step).

        One host sync (after fp16's unscaling, before scaling or clipping) brings back the
        loss, ``scale``, ``extras`` and the per-tensor gradient norms; the global norm,
        the clipping factor and the step decision are then host arithmetic, and scaling
        and clipping are one in-place multiply (none when the factor is 1). A non-finite
        loss skips the step in every precision.

        Args:
            optimizer: the optimizer over ``grads``' parameters.
            grads: the (accumulated) gradients, e.g. ``[p.grad for p in params if p.grad is not None]``.
            loss: 0-dim tensor, the loss the gradients came from (its finiteness is checked).
            scale: gradient multiplier, e.g. ``world_size / items`` (1.0: already normalised);
                a 0-dim tensor is read in the same sync.
            max_norm: clip the global norm of the scaled gradients to it, as
                ``torch.nn.utils.clip_grad_norm_`` does (None: no clipping). A non-finite
                norm clips nothing, so the non-finite gradient stays findable.
            extras: 0-dim tensors to bring to the host in the same sync (numbers to log).

        Returns:
            An :class:`UpdateResult`.
        """
        if self.scaling:
            self.scaling.unscale_(optimizer)
        synced = [loss, *extras, scale] if torch.is_tensor(scale) else [loss, *extras]
        synced = [t if t.device == loss.device else t.to(loss.device) for t in synced]  # e.g. a CPU item count
        host = torch.stack([*synced, *(torch._foreach_norm(grads) if grads else ())]).tolist()  # the one host sync
        head = len(synced)
        scale = host[head - 1] if torch.is_tensor(scale) else scale
        grad_norm = scale * math.hypot(*host[head:])  # the norm of grads * scale
        if math.isfinite(grad_norm):
            factor = scale if max_norm is None else scale * min(1.0, max_norm / (grad_norm + 1e-6))
            if factor != 1.0 and grads:
                torch._foreach_mul_(grads, factor)
        finite = math.isfinite(host[0]) and math.isfinite(grad_norm)
        if self.scaling:  # the GradScaler skips steps with inf/NaN gradients itself
            if math.isfinite(host[0]):
                took_step = self.scaling.step(optimizer)
                why = None if took_step else "overflow"
            else:
                self.scaling.skip(optimizer)
                took_step, why = False, "non-finite"
            self.scaling.update()
        else:
            took_step, why = finite, None if finite else "non-finite"
            if finite:
                optimizer.step()
        return UpdateResult(took_step, why, host[0], grad_norm, host[1:1 + len(extras)])

    def log_record(self) -> dict[str, float]:
        """Numbers for the training log: ``{"loss_scale": ...}`` under fp16, else nothing."""
        return {"loss_scale": self.scaling.get_scale()} if self.scaling else {}

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name, **(self.scaling.state_dict() if self.scaling else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the loss scale; a checkpoint from another precision keeps the default."""
        if self.scaling and "scaler" in state:
            self.scaling.load_state_dict(state)
