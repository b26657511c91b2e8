"""Mixed precision: autocast contexts and fp16 loss scaling (the GradScaler) behind one
small object; the optimizer update itself is the Trainer's (``tk.core.training.update``).

Mixed precision training: https://arxiv.org/abs/1710.03740
torch.amp: https://pytorch.org/docs/stable/amp.html
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Mapping

import torch

from tk.core.errors import TkError

__all__ = ["Precision", "LossScaling", "check_precision"]

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


class Precision:
    """Numeric precision of a run: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"``
    (autocast + loss scaling, CUDA only). The engine calls :meth:`backward` per
    micro-batch and :meth:`unscale_` before reading the gradients whatever the precision;
    under fp16 it steps through ``scaling`` (the GradScaler skips overflowing steps).

    bf16 has fp32's exponent range, so it needs no scaling.

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``train.precision``).
        device: the training device.
        autocast: False when something else casts to bf16/fp16 (FSDP's ``MixedPrecisionPolicy``
            on CUDA): :meth:`autocast` is then a no-op; fp16 keeps its loss scaling.

    Raises:
        TkError: see :func:`check_precision`.
    """

    def __init__(self, precision: str, device: torch.device | str, autocast: bool = True) -> None:
        problem = check_precision(precision, device)
        if problem:
            raise TkError(problem)
        self.name = precision
        self.device = torch.device(device)
        self.dtype = _DTYPES[precision]
        self._autocast = autocast
        self.scaling: LossScaling | None = LossScaling(torch.amp.GradScaler("cuda")) if precision == "fp16" else None
        # appended to the message that stops a run after repeated non-finite steps
        self.non_finite_hint = " fp16 overflows easily: try train.precision=bf16." if precision == "fp16" else ""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (fp16 only; 0 otherwise)."""
        return self.scaling.skipped_steps if self.scaling else 0

    def autocast(self) -> ContextManager:
        """Context for the forward pass and loss (a no-op for fp32)."""
        if self.name == "fp32" or not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, on the scaled loss under fp16."""
        if self.scaling:
            self.scaling.backward(loss)
        else:
            loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide fp16's scaled gradients by the loss scale in place (a no-op otherwise);
        call before reading or clipping the gradients."""
        if self.scaling:
            self.scaling.unscale_(optimizer)

    def log_record(self) -> dict[str, float]:
        """Numbers for the training log: ``{"loss_scale": ...}`` under fp16, else nothing."""
        return {"loss_scale": self.scaling.get_scale()} if self.scaling else {}

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name, **(self.scaling.state_dict() if self.scaling else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the loss scale; a checkpoint from another precision keeps the default."""
        if self.scaling and "scaler" in state:
            self.scaling.load_state_dict(state)
