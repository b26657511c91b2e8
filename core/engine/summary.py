"""Model summaries: parameter counts, activation memory, and each module's output shape
on one batch (``tk summary``), because most Transformer bugs are shape bugs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from tk.core.data.loader import LoaderSpec
from tk.core.run.runlog import count_parameters, format_bytes
from tk.core.training.assemble import assemble
from tk.core.training.device import enable_grad_checkpointing, move_to_device, resolve_device, seed_everything
from tk.core.training.precision import Precision

__all__ = ["ActivationMeter", "module_output_shapes", "format_shapes", "recipe_summary"]


class ActivationMeter:
    """Counts the bytes autograd keeps for backward inside the ``with`` block: the
    activation memory of one forward pass (parameters, which are saved too, excluded;
    a storage saved twice counts once).

    It measures instead of guessing, so it reflects activation checkpointing, autocast
    dtypes and in-place ops. Usage::

        with ActivationMeter(model) as meter:
            loss = task.loss(model, batch)
        meter.bytes  # int
    """

    def __init__(self, model: nn.Module) -> None:
        self._param_ptrs = {p.data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less tensors
            key, size = id(t), t.numel() * t.element_size()
        if key not in self._param_ptrs and key not in self._seen:
            self._seen.add(key)
            self.bytes += size
        return t

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _shape(x: Any) -> str:
    """Shapes of a module output: tensors, tuples/lists and dicts of them."""
    if isinstance(x, torch.Tensor):
        return str(tuple(x.shape))
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


def module_output_shapes(model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Call ``run()`` (which must call ``model``) with a forward hook on every module
    and record, in call order, each module's name, type, output shape(s) and own
    parameter count. A module called twice appears twice.

    Args:
        model: the model whose modules are hooked.
        run: runs one forward pass, e.g. ``lambda: task.loss(model, batch)``.

    Returns:
        One dict per call: ``{"name", "path", "depth", "type", "shape", "params"}``
        (``depth``: shown ancestors, for indentation).
    """
    rows: list[dict[str, Any]] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        name = names[module]
        own = sum(p.numel() for p in module.parameters(recurse=False))
        rows.append({"name": name or f"({type(model).__name__})", "path": name,
                     "type": type(module).__name__, "shape": _shape(output), "params": own})

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    # Hooks fire as modules finish, children before parents; when every module ran
    # once, list them in definition order instead, which reads top-down like the code.
    if len({r["name"] for r in rows}) == len(rows):
        order = {(n or f"({type(model).__name__})"): i for i, n in enumerate(names.values())}
        rows.sort(key=lambda r: order[r["name"]])
    # indent under the shown ancestors (containers such as ModuleList never run)
    shown = {r["path"] for r in rows}
    for r in rows:
        parts = r["path"].split(".")
        r["depth"] = 0 if not r["path"] else 1 + sum(".".join(parts[:i]) in shown for i in range(1, len(parts)))
    return rows


def format_shapes(rows: list[dict[str, Any]]) -> str:
    """A text table of :func:`module_output_shapes` rows, nested modules indented."""
    labels = ["  " * r["depth"] + r["name"] for r in rows]
    width = max([len("module")] + [len(s) for s in labels])
    twidth = max([len("type")] + [len(r["type"]) for r in rows])
    lines = [f"{'module':<{width}}  {'type':<{twidth}}  {'params':>10}  output shape"]
    for label, r in zip(labels, rows):
        lines.append(f"{label:<{width}}  {r['type']:<{twidth}}  {r['params']:>10,}  {r['shape']}")
    return "\n".join(lines)


def recipe_summary(cfg, task_cls) -> str:
    """``tk summary``: build the recipe's task and model, run one training batch
    through ``task.loss`` and describe it: batch shapes, every module's output shape,
    parameter counts and the activation memory of that batch. Nothing is trained or
    written.

    Args:
        cfg: a resolved :class:`tk.core.config.RunConfig`.
        task_cls: its task class.
    """
    t = cfg.train
    seed_everything(t.seed)
    device = resolve_device(t.device)
    precision = Precision(t.precision, device)
    built = assemble(cfg, task_cls, None, "summary",
                     build_data=lambda task: task.build_loader("train", LoaderSpec(batch_size=t.batch_size, seed=t.seed)))
    task, model = built.task, built.model.to(device).train()
    batch = move_to_device(next(iter(built.data)), device)
    if t.grad_checkpointing:
        enable_grad_checkpointing(model)
    teacher = task.build_teacher()
    task.teacher = teacher.to(device).eval().requires_grad_(False) if teacher is not None else None
    with precision.autocast():
        batch = task.transform_batch(batch, training=True)
        with torch.no_grad():
            rows = module_output_shapes(model, lambda: task.loss(model, batch))
        with ActivationMeter(model) as meter:
            task.loss(model, batch)
    total, trainable = count_parameters(model)
    lines = [
        f"task {cfg.task}: {type(model).__name__}, {total:,} parameters ({trainable:,} trainable, "
        f"{format_bytes(4 * total)} in fp32), on {device} ({t.precision})",
        f"batch: {_shape(batch)}",
        "",
        format_shapes(rows),
        "",
        f"activation memory: {format_bytes(meter.bytes)} for this batch of {t.batch_size} "
        f"(tensors saved for backward; train.grad_checkpointing=true trades it for recompute)",
    ]
    return "\n".join(lines)
