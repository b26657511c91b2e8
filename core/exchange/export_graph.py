"""``tk export --format torch-export|onnx``: the model's inference forward as a graph.

The task supplies example inputs (:meth:`tk.core.task.Task.example_inputs`: keyword arguments
of ``model.forward``). Every input's dim 0 is a dynamic batch; a 2-D integer input (token ids)
also gets a dynamic sequence length (dim 1). ``torch.export.export`` traces the forward
(https://pytorch.org/docs/stable/export.html) into a ``.pt2`` file (``torch.export.save``);
``torch.onnx.export(..., dynamo=True)`` turns the same program into ONNX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim

from tk.core.errors import TkError

__all__ = ["dynamic_shapes", "example_inputs", "export_onnx", "export_program"]


def example_inputs(task: Any, model: nn.Module) -> dict[str, Tensor]:
    """The task's example inputs, on the model's device.

    Raises:
        TkError: the task has no ``example_inputs`` hook.
    """
    inputs = task.example_inputs(model)
    if not inputs:
        raise TkError(f"task {task.name!r} gives no example inputs (Task.example_inputs), so its model cannot be "
                      f"traced for torch-export/onnx; use --format safetensors")
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in inputs.items()}


def dynamic_shapes(inputs: dict[str, Tensor]) -> dict[str, dict[int, Any]]:
    """Dim 0 of every input is the batch; dim 1 of a 2-D integer input is the sequence length."""
    shapes = {}
    for name, t in inputs.items():
        dims: dict[int, Any] = {0: Dim.DYNAMIC}
        if t.ndim == 2 and not t.is_floating_point():
            dims[1] = Dim.DYNAMIC
        shapes[name] = dims
    return shapes


def export_program(model: nn.Module, inputs: dict[str, Tensor]) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` (eval mode) on ``inputs`` with dynamic batch/sequence.

    Raises:
        TkError: the forward cannot be traced (first line of torch's reason).
    """
    model.eval()
    try:
        with torch.no_grad():
            return torch.export.export(model, (), inputs, dynamic_shapes=dynamic_shapes(inputs), strict=False)
    except Exception as e:  # torch raises many kinds (unsupported op, guard on a dynamic dim)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TkError(f"torch.export could not trace {type(model).__name__}: {first}") from e


def export_onnx(model: nn.Module, inputs: dict[str, Tensor], path: Path) -> None:
    """Write ``model``'s forward as ONNX to ``path`` (torch's dynamo exporter; needs ``onnxscript``).

    Raises:
        TkError: onnx/onnxscript missing, or the export fails.
    """
    try:
        import onnxscript  # noqa: F401  (lazy: only onnx exports need it; torch.onnx imports it too)
    except ImportError as e:
        raise TkError("--format onnx needs the onnx and onnxscript packages; pip install onnx onnxscript") from e
    model.eval()
    try:
        with torch.no_grad():
            program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, dynamic_shapes=dynamic_shapes(inputs),
                                        input_names=list(inputs), output_names=["output"], verbose=False)
        program.save(str(path))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TkError(f"torch.onnx.export failed for {type(model).__name__}: {first}") from e
