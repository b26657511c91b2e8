"""Pieces of the training loop: the resumable stream of training batches, gradient
scaling and clipping, stop signals, evaluation over a split, and RNG isolation (so
evaluation and data replay never shift the random numbers training draws).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from tk.core.errors import TkError

__all__ = ["TrainingInterrupted", "move_to_device", "preserved_rng", "BatchStream", "FixedBatches",
           "scale_and_clip_", "stop_signals", "config_diff", "evaluate_loader"]


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run; a checkpoint of ``step`` was saved first."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}{where}; "
                         f"continue with `tk run ... --resume`")


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Recursively move the tensors of a batch (dicts, lists, tuples) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the block, then put every RNG (python, numpy, torch, CUDA) back as it was."""
    from tk.core.checkpoint import capture_rng_state, restore_rng_state

    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


class BatchStream:
    """The training batches, pass after pass, with a position that checkpoints can hold.

    Each pass is cut to ``batches_per_epoch`` (a multiple of ``grad_accum``): the last
    few micro-batches that cannot fill an update are dropped, so an update never mixes
    two passes, and ``grad_accum=4, batch_size=8`` sees exactly the samples of
    ``grad_accum=1, batch_size=32`` in every update (same sampler order).

    The order of a pass is a pure function of (seed, epoch) (the samplers of
    ``tk.core.data``); on resume the pass is replayed and the consumed batches are
    loaded and dropped, with the RNG states preserved around both, so the batches and
    the random numbers after a resume match an uninterrupted run.

    Args:
        loader: the training loader (samplers with ``set_epoch`` get the pass number).
        batches_per_epoch: micro-batches used per pass.
        seed: base seed for DataLoader worker seeds; rank: the process rank.
    """

    def __init__(self, loader, batches_per_epoch: int, seed: int = 0, rank: int = 0) -> None:
        self.loader = loader
        self.batches_per_epoch = batches_per_epoch
        self.seed, self.rank = seed, rank
        self.epoch = 0  # passes started
        self.batch = 0  # batches consumed in the current pass
        self._it: Iterator | None = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._it = None

    def next(self) -> Any:
        """The next micro-batch (on the host)."""
        for _ in range(2):
            if self.batch >= self.batches_per_epoch:
                self.epoch, self.batch, self._it = self.epoch + 1, 0, None
            if self._it is None:
                self._it = self._open()
            try:
                batch = next(self._it)
            except StopIteration:  # the loader gave fewer batches than expected this pass
                self.batch = self.batches_per_epoch
                continue
            self.batch += 1
            return batch
        raise TkError(f"the training loader yielded no batches in pass {self.epoch}; check the train split")

    def _open(self) -> Iterator:
        with preserved_rng():
            for part in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
                if hasattr(part, "set_epoch"):
                    part.set_epoch(self.epoch)
            if isinstance(self.loader, DataLoader):
                # DataLoader draws its worker seed from the global RNG unless it has a
                # generator; a (seed, rank, epoch) one keeps the global stream untouched.
                self.loader.generator = torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + self.epoch) * 1_009 + self.rank)
            it = iter(self.loader)
            for _ in range(self.batch):  # resume mid-pass
                next(it)
        return it


class FixedBatches:
    """``train.overfit_batches``: the first ``n`` batches of pass 0, repeated forever
    (a sanity check: a model that cannot drive their loss near zero has a bug)."""

    def __init__(self, loader, n: int) -> None:
        with preserved_rng():
            if isinstance(loader, DataLoader):
                loader.generator = torch.Generator().manual_seed(0)
            it = iter(loader)
            self.batches = [b for _, b in zip(range(n), it)]
        if len(self.batches) < n:
            raise TkError(f"train.overfit_batches: the train split has only {len(self.batches)} batches, "
                          f"asked for {n}; lower train.overfit_batches")
        self.epoch = 0
        self.batch = 0  # batches served in total

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def next(self) -> Any:
        batch = self.batches[self.batch % len(self.batches)]
        self.batch += 1
        self.epoch = self.batch // len(self.batches)
        return batch


def scale_and_clip_(grads: list[torch.Tensor], scale: float | torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """Multiply ``grads`` by ``scale`` and clip their global L2 norm to ``max_norm``, in
    one pass over the gradients (in place).

    Args:
        grads: the gradients.
        scale: e.g. ``world_size / items`` (1.0 when the loss was normalised already).
        max_norm: clipping threshold (None: no clipping).

    Returns:
        The global norm of ``grads * scale`` before clipping, a 0-dim tensor (reading
        it is the caller's host sync). A non-finite norm clips nothing, so the
        non-finite gradient stays findable.
    """
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads)
    try:
        norm = torch.linalg.vector_norm(torch.stack(norms).float()) * scale
    except RuntimeError:  # gradients of mixed dtypes
        norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) * scale
    factor = scale
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        factor = scale * torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    if torch.is_tensor(factor) or factor != 1.0:
        factor = factor if torch.is_tensor(factor) else torch.tensor(factor, device=grads[0].device)
        torch._foreach_mul_(grads, factor.float())
    return norm


@contextlib.contextmanager
def stop_signals(on_signal: Callable[[int], None], rearm: bool = True) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``on_signal(signum)`` inside the block (main thread only).

    Args:
        on_signal: called from the handler; it should only set a flag.
        rearm: put the previous handler back after the first signal, so a second one
            acts at once (Ctrl-C twice). Off under torchrun, which passes the
            terminal's Ctrl-C on a second time and escalates to SIGKILL itself.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum, _frame):
        on_signal(signum)
        if rearm:
            signal.signal(signum, previous[signum] if previous[signum] is not None else signal.SIG_DFL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``["model.hidden: 32 -> 64", ...]`` for every leaf that differs."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, path = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, path + ".")
        elif a != b:
            out.append(f"{path}: {a!r} -> {b!r}")
    return out



@torch.no_grad()
def evaluate_loader(task, model: nn.Module, loader, device: torch.device, precision, split: str,
                    prefix: str | None = None) -> dict[str, float]:
    """Loss and the task's metrics over ``loader``, merged across processes.

    Args:
        task: the task (``eval_step``, ``build_metrics``, ``transform_batch``).
        model: the model to evaluate (put in eval mode for the pass, then restored).
        loader: batches of the split (sharded per process when distributed).
        device: where the model is.
        precision: a ``tk.core.precision.Precision`` (autocast).
        split: the split name given to ``build_metrics``.
        prefix: key prefix of the results (default ``split``), e.g. ``"val_ema"``.

    Returns:
        ``{"<prefix>/loss": ..., "<prefix>/<metric>": ...}``; the loss is per item.
    """
    from tk.core.distributed import all_reduce_sum

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
