"""Mixed precision: autocast contexts and fp16 loss scaling behind one small object.

Mixed precision training: https://arxiv.org/abs/1710.03740
torch.amp: https://pytorch.org/docs/stable/amp.html
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Mapping

import torch

from tk.core.errors import TkError

__all__ = ["Precision", "LossScaling"]

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


class Precision:
    """Numeric precision of a run: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"``
    (autocast + loss scaling, CUDA only).

    With fp32/bf16 the scaling methods are plain ``loss.backward()`` /
    ``optimizer.step()`` (bf16 has fp32's exponent range, so no scaling is needed).

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``train.precision``).
        device: the training device.

    Raises:
        TkError: unknown precision, fp16 off CUDA, or bf16 on a GPU without bf16 support.
    """

    def __init__(self, precision: str, device: torch.device | str) -> None:
        if precision not in _DTYPES:
            raise TkError(f"train.precision must be one of {sorted(_DTYPES)}, got {precision!r}")
        self.name = precision
        self.device = torch.device(device)
        self.dtype = _DTYPES[precision]
        self.scaling: LossScaling | None = None
        if precision == "fp16":
            if self.device.type != "cuda":
                raise TkError(
                    f"train.precision: fp16 needs a CUDA device (got {self.device.type!r}); use bf16 on CPU"
                )
            self.scaling = LossScaling(torch.amp.GradScaler("cuda"))
        if precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise TkError(
                f"train.precision: bf16 is not supported by {torch.cuda.get_device_name(self.device)}; "
                "use fp16 (loss scaling) or fp32"
            )

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

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``.grad`` hold true gradients (call before clipping or reading norms)."""
        if self.scaling:
            self.scaling.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step; returns False when fp16 skipped it for inf/NaN gradients."""
        if self.scaling:
            return self.scaling.step(optimizer)
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the loss scale after each update (no-op without fp16)."""
        if self.scaling:
            self.scaling.update()

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name, **(self.scaling.state_dict() if self.scaling else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the loss scale; a checkpoint from another precision keeps the default."""
        if self.scaling and "scaler" in state:
            self.scaling.load_state_dict(state)
