"""The training engine: the one loop every task runs through.

The task supplies data, model, loss and metrics (``tk.core.task.Task``); this module
owns devices, precision, gradient accumulation, clipping, the LR schedule,
evaluation, checkpoints and logging.

Gradient accumulation is exact: a task's loss is *summed* over its items and the
accumulated gradient is divided once by the item count of all micro-batches (and
processes), so ``grad_accum=4, batch_size=8`` updates the weights exactly as
``grad_accum=1, batch_size=32`` does (fairseq's ``sample_size`` normalisation).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from tk.core.config import RunConfig
from tk.core.data import LoaderSpec
from tk.core.errors import TkError
from tk.core.task import StepOutput, Task


def resolve_device(name: str) -> torch.device:
    """``train.device`` -> a torch device ("auto" picks CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise TkError(f"train.device: {name!r} is not a device; use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TkError(f"train.device: {name!r} requested but CUDA is not available; use train.device=cpu")
    return device


def preflight(cfg: RunConfig) -> torch.device:
    """Checks that need the machine (device, precision support), run before a run
    directory is created. Raises TkError."""
    from tk.core.precision import Precision

    device = resolve_device(cfg.train.device)
    Precision(cfg.train.precision, device)
    return device


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch; optionally force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Recursively move the tensors of a batch (dicts, lists, tuples) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _as_float(x: int | float | torch.Tensor) -> float:
    return float(x.detach().float().item()) if isinstance(x, torch.Tensor) else float(x)


class RunLog:
    """Writes ``metrics.jsonl`` and ``train.log`` in the run dir (main process only)
    and echoes human-readable lines to the console."""

    def __init__(self, run_dir: Path | None, enabled: bool = True) -> None:
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self._bar = None

    def attach_bar(self, bar) -> None:
        self._bar = bar

    def echo(self, message: str) -> None:
        if not self.enabled and self.run_dir is not None:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)
        if self.enabled:
            with open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
                f.write(message + "\n")

    def metrics(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


class Trainer:
    """Builds a task's data, model and optimiser and runs the train/eval loop.

    Args:
        cfg: the resolved run config.
        task_cls: the task class named by ``cfg.task``.
        run_dir: where logs, metrics and checkpoints go (None: write nothing).
        dist: process-group info from ``tk.core.distributed.init_distributed``
            (None for a single process).
    """

    def __init__(self, cfg: RunConfig, task_cls: type[Task], run_dir: Path | None, dist=None) -> None:
        from tk.core.checkpoint import CheckpointManager
        from tk.core.optim import build_optimizer
        from tk.core.precision import Precision

        self.cfg, self.tcfg = cfg, cfg.train
        self.rank = dist.rank if dist else 0
        self.world_size = dist.world_size if dist else 1
        self.is_main = self.rank == 0
        self.device = dist.device if dist else resolve_device(self.tcfg.device)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.log = RunLog(self.run_dir, enabled=self.is_main)
        seed_everything(self.tcfg.seed + self.rank, self.tcfg.deterministic)
        self.precision = Precision(self.tcfg.precision, self.device)

        self.task = task_cls(cfg)
        self.task.setup(str(self.run_dir) if self.run_dir else None)
        self.train_loader = self._loader("train", training=True)
        self.val_loader = None  # built on first evaluation
        self.steps_per_epoch = max(1, len(self.train_loader) // self.tcfg.grad_accum)
        self.total_steps = self.tcfg.max_steps or self.tcfg.epochs * self.steps_per_epoch

        self.model = self.task.build_model().to(self.device)
        self.task.teacher = self._prepare_teacher(self.task.build_teacher())
        self.ddp_model = self._wrap_ddp(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = self._build_scheduler()
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=self.tcfg.keep_last) \
            if self.run_dir is not None and self.is_main else None
        self.best_key = self.tcfg.best_metric or "val/loss"
        self.best_mode = self.tcfg.best_mode if self.tcfg.best_metric else "min"

        # progress state (all of it goes into checkpoints)
        self.step = 0  # optimizer updates done
        self.data_epoch = 0  # passes over the training data started
        self.batch_in_epoch = 0  # batches consumed in the current pass
        self.best_value: float | None = None
        self.bad_steps = 0
        self._train_iter: Iterator | None = None

    # -- set-up helpers --------------------------------------------------------------
    def _loader(self, split: str, training: bool):
        t = self.tcfg
        spec = LoaderSpec(
            batch_size=t.batch_size if training else (t.eval_batch_size or t.batch_size),
            shuffle=training, drop_last=training, seed=t.seed, num_workers=t.num_workers,
            rank=self.rank, world_size=self.world_size, pin_memory=self.device.type == "cuda",
        )
        loader = self.task.build_loader(split, spec)
        if len(loader) == 0:
            size = len(loader.dataset) if hasattr(loader, "dataset") else "?"
            raise TkError(f"the {split} split yields no batches ({size} samples, batch size "
                          f"{spec.batch_size} x {self.world_size} processes); add data or lower "
                          f"train.{'batch_size' if training else 'eval_batch_size'}")
        return loader

    def _prepare_teacher(self, teacher: nn.Module | None) -> nn.Module | None:
        if teacher is None:
            return None
        teacher = teacher.to(self.device).eval()
        teacher.requires_grad_(False)
        return teacher

    def _wrap_ddp(self, model: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def _build_scheduler(self):
        from tk.core.schedule import build_scheduler

        return build_scheduler(self.optimizer, self.cfg.schedule, self.total_steps)

    # -- data ------------------------------------------------------------------------
    def _next_batch(self) -> dict[str, Any]:
        """The next training batch; passes over the data follow each other seamlessly."""
        while True:
            if self._train_iter is None:
                sampler = getattr(self.train_loader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.data_epoch)
                self._train_iter = iter(self.train_loader)
                for _ in range(self.batch_in_epoch):  # resume mid-pass
                    next(self._train_iter)
            try:
                batch = next(self._train_iter)
            except StopIteration:
                self._train_iter = None
                self.data_epoch += 1
                self.batch_in_epoch = 0
                continue
            self.batch_in_epoch += 1
            return move_to_device(batch, self.device)

    # -- one update ------------------------------------------------------------------
    def _forward_backward(self, batch: dict[str, Any], sync: bool) -> StepOutput:
        no_sync = getattr(self.ddp_model, "no_sync", None)
        # DDP all-reduces gradients only on the last micro-batch of an update.
        ctx = no_sync() if (no_sync is not None and not sync) else contextlib.nullcontext()
        with ctx:
            with self.precision.autocast():
                batch = self.task.transform_batch(batch, training=True)
                out = self.task.loss(self.ddp_model, batch)
            self.precision.backward(out.loss)
        return out

    def train_step(self) -> dict[str, float]:
        """One optimizer update over ``grad_accum`` micro-batches; returns its stats."""
        self.ddp_model.train()
        loss_sum = torch.zeros((), device=self.device)
        items = torch.zeros((), device=self.device)
        logs: dict[str, float] = {}
        for i in range(self.tcfg.grad_accum):
            out = self._forward_backward(self._next_batch(), sync=i == self.tcfg.grad_accum - 1)
            loss_sum += out.loss.detach().float()
            items += out.num_items
            for k, v in out.logs.items():
                logs[k] = logs.get(k, 0.0) + _as_float(v)
        if self.world_size > 1:
            stats = torch.stack([loss_sum, items])
            torch.distributed.all_reduce(stats)
            loss_sum, items = stats[0], stats[1]
        return self._apply_update(loss_sum, items, logs)

    def _apply_update(self, loss_sum: torch.Tensor, items: torch.Tensor, logs: dict[str, float]) -> dict[str, float]:
        n_items = max(float(items.item()), 1.0)
        self.precision.unscale_(self.optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # The loss was summed over items; DDP averaged gradients over processes.
        if grads:
            torch._foreach_mul_(grads, self.world_size / n_items)
        grad_norm = self._grad_norm(grads)
        loss = float(loss_sum.item()) / n_items
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite or self.tcfg.precision == "fp16":  # fp16: GradScaler skips inf steps itself
            took_step = self.precision.step(self.optimizer)
            self.precision.update()
        else:
            took_step = False
        self.optimizer.zero_grad(set_to_none=True)
        if took_step:
            self.scheduler.step()
            self.bad_steps = 0
        elif not finite and self.tcfg.precision != "fp16" or not math.isfinite(loss):
            self._on_bad_step(loss, grad_norm)
        self.step += 1
        stats = {"loss": loss, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                 "items": n_items, "skipped": 0.0 if took_step else 1.0}
        stats.update({k: v / n_items for k, v in logs.items()})
        return stats

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        if not grads:
            return 0.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if self.tcfg.clip_grad_norm is not None and torch.isfinite(norm):
            scale = torch.clamp(self.tcfg.clip_grad_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, scale)
        return float(norm.item())

    def _on_bad_step(self, loss: float, grad_norm: float) -> None:
        self.bad_steps += 1
        culprit = next((n for n, p in self.model.named_parameters()
                        if p.grad is not None and not torch.isfinite(p.grad).all()), None)
        where = f"; first non-finite gradient in {culprit!r}" if culprit else ""
        self.log.echo(f"step {self.step + 1}: non-finite loss {loss} / grad norm {grad_norm}, update skipped{where}")
        if self.bad_steps >= self.tcfg.max_bad_steps:
            hint = " fp16 overflows easily: try train.precision=bf16." if self.tcfg.precision == "fp16" else ""
            raise RuntimeError(
                f"{self.bad_steps} non-finite steps in a row at step {self.step + 1}; check the learning "
                f"rate (optim.lr), the data and the loss for NaN/inf.{hint}")

    # -- evaluation ------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str = "val", model: nn.Module | None = None) -> dict[str, float]:
        """Loss and task metrics over one split, merged across processes."""
        model = model or self.model
        if split == "val":
            self.val_loader = self.val_loader or self._loader("val", training=False)
            loader = self.val_loader
        else:
            loader = self._loader(split, training=False)
        was_training = model.training
        model.eval()
        metrics = self.task.build_metrics(split)
        for m in metrics.values():
            m.to(self.device)
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in loader:
            batch = move_to_device(batch, self.device)
            with self.precision.autocast():
                batch = self.task.transform_batch(batch, training=False)
                out = self.task.eval_step(model, batch)
            totals[0] += out.loss.detach().double()
            totals[1] += out.num_items
            for m in metrics.values():
                m.update(out, batch)
        if self.world_size > 1:
            torch.distributed.all_reduce(totals)
        results = {f"{split}/loss": float(totals[0] / totals[1].clamp(min=1))}
        for metric in metrics.values():
            metric.sync()
            results.update({f"{split}/{k}": float(v) for k, v in metric.compute().items()})
        model.train(was_training)
        return results

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        from tk.core.checkpoint import capture_rng_state

        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "precision": self.precision.state_dict(),
            "step": self.step, "data_epoch": self.data_epoch, "batch_in_epoch": self.batch_in_epoch,
            "best_value": self.best_value, "rng": capture_rng_state(),
            "config": self.cfg.to_dict(), "task": self.cfg.task, "task_state": self.task.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from tk.core.checkpoint import load_model_state, restore_rng_state

        load_model_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        self.task.load_state_dict(state.get("task_state", {}))
        self.step, self.best_value = state["step"], state["best_value"]
        self.data_epoch, self.batch_in_epoch = state["data_epoch"], state["batch_in_epoch"]
        self._train_iter = None
        restore_rng_state(state["rng"])

    def resume(self) -> None:
        """Continue from the latest checkpoint in the run dir."""
        from tk.core.checkpoint import load_checkpoint

        latest = self.run_dir / "checkpoints" / "last.pt" if self.run_dir else None
        if latest is None or not latest.exists():
            raise TkError(f"--resume: no checkpoint found at {latest}; start a new run with --overwrite")
        self.load_state_dict(load_checkpoint(latest, map_location=self.device))
        self.log.echo(f"resumed from {latest} at step {self.step}")

    def _save(self, metric: float | None) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(self.state_dict(), step=self.step, metric=metric, mode=self.best_mode)

    def _is_better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.best_mode == "max" else value < self.best_value

    # -- the loop --------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``, evaluating and checkpointing along the way.

        Returns:
            The last evaluation's results (``{"val/loss": ..., "val/top1": ...}``).
        """
        self._print_summary()
        bar = self._progress_bar()
        results: dict[str, float] = {}
        window: list[dict[str, float]] = []
        tic = time.perf_counter()
        while self.step < self.total_steps:
            stats = self.train_step()
            window.append(stats)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}", refresh=False)
            if self.step % self.tcfg.log_every == 0 or self.step == self.total_steps:
                elapsed = time.perf_counter() - tic
                self._log_train(window, elapsed)
                window, tic = [], time.perf_counter()
            if self._eval_due():
                results = self._evaluate_and_save()
        if bar is not None:
            bar.close()
            self.log.attach_bar(None)
        if self.checkpoints is not None:
            from tk.core.checkpoint import export_safetensors

            export_safetensors(self.model, self.run_dir / "model.safetensors")
        return results

    def _eval_due(self) -> bool:
        if self.step == self.total_steps:
            return True
        if self.tcfg.eval_every is not None:
            return self.step % self.tcfg.eval_every == 0
        return self.step % self.steps_per_epoch == 0

    def _evaluate_and_save(self) -> dict[str, float]:
        results = self.evaluate("val")
        value = results.get(self.best_key)
        if value is None:
            raise TkError(f"train.best_metric: {self.best_key!r} is not among the evaluation results "
                          f"({', '.join(results)})")
        improved = self._is_better(value)
        if improved:
            self.best_value = value
        self.log.metrics({"step": self.step, "epoch": self.step / self.steps_per_epoch, "split": "val", **results})
        shown = "  ".join(f"{k}={v:.4f}" for k, v in results.items())
        self.log.echo(f"step {self.step}/{self.total_steps}  {shown}" + ("  (best)" if improved else ""))
        self._save(value)
        return results

    def _log_train(self, window: list[dict[str, float]], elapsed: float) -> None:
        items = sum(s["items"] for s in window)
        record = {"step": self.step, "epoch": self.step / self.steps_per_epoch, "split": "train",
                  "loss": sum(s["loss"] * s["items"] for s in window) / max(items, 1.0),
                  "lr": window[-1]["lr"], "grad_norm": window[-1]["grad_norm"],
                  "items_per_s": items / max(elapsed, 1e-9), "skipped_steps": sum(s["skipped"] for s in window)}
        extra = {k for s in window for k in s} - {"loss", "grad_norm", "lr", "items", "skipped"}
        record.update({k: sum(s.get(k, 0.0) for s in window) / len(window) for k in sorted(extra)})
        self.log.metrics(record)

    def _progress_bar(self):
        if not (self.tcfg.progress and self.is_main):
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        self.log.attach_bar(bar)
        return bar

    def _print_summary(self) -> None:
        total, trainable = count_parameters(self.model)
        t = self.tcfg
        self.log.echo(
            f"task {self.cfg.task}: {type(self.model).__name__} with {total:,} parameters "
            f"({trainable:,} trainable) on {self.device} ({t.precision}); {self.total_steps} updates "
            f"of {t.batch_size} x {t.grad_accum} x {self.world_size} samples "
            f"({self.steps_per_epoch} updates per epoch)")
