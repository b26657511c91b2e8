"""The training engine: the one loop every task runs through.

The task supplies data, model, loss and metrics (``tk.core.task.Task``); this module owns devices,
precision, gradient accumulation, clipping, the LR schedule, EMA, evaluation, checkpoints, resume and logging.

One update's stages are :meth:`Trainer.train_step` (gradient arithmetic in
``tk.core.training.update``); what a checkpoint holds is ``tk.core.engine.trainer_state``.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tk.core.config import RunConfig
from tk.core.distributed import agreed_log_keys, main_process_first
from tk.core.engine.summary import ActivationMeter
from tk.core.engine.trainer_state import load_trainer_state, trainer_state
from tk.core.errors import TkError
from tk.core.exchange.export import export_safetensors, tk_metadata
from tk.core.optim import build_optimizer
from tk.core.run.checkpoint import CheckpointManager, read_resume_checkpoint
from tk.core.run.curves import CurvesWriter
from tk.core.run.loggers import open_loggers
from tk.core.run.rng import preserved_rng
from tk.core.run.runlog import ProgressBar, RunLog, Throughput, format_bytes, run_summary, train_line, train_record
from tk.core.run.shards import SHARDS_KEY, save_shards
from tk.core.schedule import build_scheduler
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.core.training.assemble import assemble
from tk.core.training.best import BestTracker
from tk.core.training.build import batch_stream, check_best_metric, prepare_teacher, run_loaders, split_loader
from tk.core.training.device import enable_grad_checkpointing, move_to_device, resolve_device, seed_everything
from tk.core.training.ema import ModelEMA
from tk.core.training.evaluate import evaluate_loader
from tk.core.training.parallel import autocast_needed, full_model_state, gathered, gradient_sync, is_fsdp, wrap_model
from tk.core.training.precision import Precision
from tk.core.training.progress import RunProgress, eval_due
from tk.core.training.signals import StopRequest, TrainingInterrupted, stop_signals
from tk.core.training.update import (
    Synced,
    UpdateSums,
    first_non_finite,
    normalise_and_clip_,
    step_or_skip,
    sync_to_host,
)

__all__ = ["Trainer"]


class Trainer:
    """Builds a task's data, model and optimiser and runs the train/eval loop.

    Args:
        cfg: the resolved run config.
        task_cls: the task class named by ``cfg.task``.
        run_dir: where logs, metrics and checkpoints go (None: write nothing).
        dist: process-group info from ``tk.core.distributed.init_distributed``
            (None for a single process). Only rank 0 writes.
    """

    def __init__(self, cfg: RunConfig, task_cls: type[Task], run_dir: Path | None, dist=None,
                 resume_from: str | Path | None = None) -> None:
        self.cfg, self.tcfg = cfg, cfg.train
        t = self.tcfg
        self.rank, self.world_size = (dist.rank, dist.world_size) if dist else (0, 1)
        self.is_main = self.rank == 0
        self.device = dist.device if dist else resolve_device(t.device)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.log = RunLog(self.run_dir, enabled=self.is_main, csv="csv" in t.loggers)
        seed_everything(t.seed + self.rank, t.deterministic)
        self.precision = Precision(t.precision, self.device, autocast=autocast_needed(t.strategy, self.device))
        state = read_resume_checkpoint(resume_from, self.device, cfg.task) if resume_from is not None else None
        loaders = partial(run_loaders, t=t, rank=self.rank, world_size=self.world_size, device=self.device)
        with self.log.messages(task_cls.__module__):  # what the assembly reports (a source, adapters): train.log
            built = assemble(cfg, task_cls, self.run_dir, "resume" if state else "train", state=state,
                             build_data=loaders, main_first=main_process_first)
        self.task, self.model = built.task, built.model
        self.train_loader, self.val_loader = built.data
        self.batches, self.steps_per_epoch = batch_stream(self.train_loader, t, self.rank, self.world_size,
                                                          self.log.echo)
        self.total_steps = t.max_steps if t.max_steps is not None else t.epochs * self.steps_per_epoch
        self.best = BestTracker(t.best_metric or "val/loss", t.best_mode, t.early_stopping_patience)
        check_best_metric(self.task, self.best.key, with_ema=t.ema_decay is not None)

        if t.grad_checkpointing:
            enable_grad_checkpointing(self.model)
        if not hasattr(self.model, "tk_fill_weights"):  # else FSDP materialises it, each process its shards
            self.model.to(self.device)
        self.task.teacher = prepare_teacher(self.task.build_teacher(), self.device)
        self.ddp_model = wrap_model(self.model, t.strategy, self.device, self.world_size, t.precision, t.fsdp_reshard)
        self.train_model = torch.compile(self.ddp_model, mode=t.compile_mode) if t.compile else self.ddp_model
        self.ema = ModelEMA(self.model, t.ema_decay, t.ema_warmup_steps) if t.ema_decay is not None else None
        self.optimizer = build_optimizer(self.model, cfg.optim, groups=self.task.param_groups(self.model, cfg.optim))
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, max(self.total_steps, 1))
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=t.keep_last) \
            if self.run_dir is not None and self.is_main else None
        self._params = [p for p in self.model.parameters() if p.requires_grad]

        # progress (all of it goes into checkpoints)
        self.step = 0  # optimizer updates done (skipped ones included)
        self.counts = RunProgress()
        self._resumed_at: int | None = None  # the step a resumed run continues from
        self._rewound = False  # resumed from a checkpoint before the latest one (--resume-from)
        self._curves = CurvesWriter(self.run_dir) if self.run_dir is not None and self.is_main and t.curves else None
        self.stop = StopRequest()  # set by the SIGINT/SIGTERM handler, agreed on after each update
        self._saved_step = -1
        self._activation_bytes: int | None = None
        self._in_update = False  # a failure inside an update leaves no consistent state to save
        self._log_keys: list[str] | None = None  # StepOutput.logs keys every process agreed on
        # whether a failure may save the completed updates (the launcher says no while the run
        # that --overwrite set aside is still kept: restoring it then loses nothing on disk)
        self.save_on_failure: Callable[[], bool] = lambda: True
        if state is not None:
            self._resume(state, resume_from)

    # -- state -----------------------------------------------------------------------
    @property
    def progress(self) -> dict[str, Any]:
        """The run's counters and best-metric state, as checkpoints store them (a copy)."""
        return {**self.counts.state_dict(), **self.best.state_dict()}

    @property
    def best_mode(self) -> str:
        """``"min"`` or ``"max"``: how ``train.best_metric`` improves."""
        return self.best.mode

    # -- one update ------------------------------------------------------------------
    def _prescale(self) -> bool:
        """Where the loss is normalised: in the forward when one micro-batch on one process
        makes the update (its item count is known there; saves a pass over the gradients),
        else in the update, by ``world_size / items`` of all micro-batches and processes."""
        return self.tcfg.grad_accum == 1 and self.world_size == 1

    def _forward_backward(self, batch: dict[str, Any], sync: bool, prescale: bool) -> StepOutput:
        batch = move_to_device(batch, self.device)
        meter = ActivationMeter(self.model) if self._activation_bytes is None and not self.tcfg.compile else None
        with gradient_sync(self.ddp_model, sync):  # gradients are reduced on the last micro-batch only
            with meter or contextlib.nullcontext(), self.precision.autocast():
                batch = self.task.transform_batch(batch, training=True)
                out = self.task.loss(self.train_model, batch)
            loss = out.loss
            if prescale:  # see _prescale
                loss = loss / (out.num_items.clamp(min=1) if torch.is_tensor(out.num_items) else max(out.num_items, 1))
            self.precision.backward(loss)
        if meter is not None:  # the first micro-batch only
            self._activation_bytes = meter.bytes
            self.log.echo(f"activation memory: {format_bytes(meter.bytes)} per micro-batch of "
                          f"{self.tcfg.batch_size} (tensors saved for backward, measured on the first one)")
        return out

    def train_step(self) -> dict[str, float]:
        """One optimizer update over ``grad_accum`` micro-batches, its stages in order.

        Returns:
            ``loss`` (per item), ``grad_norm`` (before clipping), ``lr``, ``items``,
            ``skipped`` (1.0 if the update was not applied) and the task's logs per item.
        """
        if not self.model.training:  # evaluation restores the mode, so only before the first update
            self.train_model.train()
        accum, prescale = self.tcfg.grad_accum, self._prescale()
        # forward -> backward, per micro-batch; the sums stay on the device (no host sync here)
        sums = UpdateSums()
        for i in range(accum):
            sums.add(self._forward_backward(self.batches.next(), sync=i == accum - 1, prescale=prescale))
        # reduce: one all-reduce over processes
        if self.world_size > 1 and sorted(sums.logs) != self._log_keys:  # before the all-reduce: lengths must match
            self._log_keys = agreed_log_keys(sorted(sums.logs), self.world_size)
        loss, items, stop, logs = sums.all_reduce(float(self.stop.received > 0), self.world_size, self.device)
        # normalise by items: the loss was summed over items, DDP averaged gradients over processes
        scale = 1.0 if prescale else self.world_size / (items.clamp(min=1) if torch.is_tensor(items) else max(items, 1))
        # unscale (fp16), then the update's one host sync: loss, scale, counts, logs, per-tensor grad norms
        lr = max(self.scheduler.get_last_lr())  # this update's (the scheduler steps after it)
        grads = [p.grad for p in self._params if p.grad is not None]
        self.precision.unscale_(self.optimizer)
        host = sync_to_host(loss, grads, scale, [items, stop, *logs.values()])
        # normalise and clip: one in-place multiply (none when the factor is 1)
        normalise_and_clip_(grads, host.scale, host.grad_norm, self.tcfg.clip_grad_norm)
        # optimizer step, or skip a non-finite one (fp16: the GradScaler skips overflows, then adjusts its scale)
        skipped = step_or_skip(self.optimizer, self.precision.scaling, host)
        stats = self._count_update(host, skipped, lr, list(logs))  # before zeroing: a bad step names its culprit
        # zero, schedule (the lr follows the update count, skipped updates included), EMA
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if skipped is None and self.ema is not None:
            self.ema.update(self.model)
        self.step += 1
        return stats

    def _count_update(self, host: Synced, skipped: str | None, lr: float, log_keys: list[str]) -> dict[str, float]:
        """Progress counters (items seen, skipped and bad steps, an agreed stop) and the update's stats."""
        items, stop, *values = host.numbers
        items = max(float(items), 1.0)
        self.stop.agree(stop)
        self.counts.count_update(items, skipped)
        if skipped == "non-finite":  # fp16 overflows are the scaler's business
            self._on_bad_step(host.loss / items, host.grad_norm)
        stats = {"loss": host.loss / items, "grad_norm": host.grad_norm, "lr": lr, "items": items,
                 "skipped": 0.0 if skipped is None else 1.0}
        stats.update({k: v / items for k, v in zip(log_keys, values)})
        return stats

    def _on_bad_step(self, loss: float, grad_norm: float) -> None:
        culprit = first_non_finite(self.model.named_parameters())
        where = f"; first non-finite gradient in {culprit!r}" if culprit else ""
        self.log.echo(f"step {self.step + 1}: non-finite loss {loss} / grad norm {grad_norm}, update skipped{where}")
        if self.counts.bad_steps >= self.tcfg.max_bad_steps:
            log = f" Details per step in {self.run_dir / 'train.log'}." if self.run_dir else ""
            raise RuntimeError(
                f"{self.counts.bad_steps} non-finite steps in a row at step {self.step + 1}{where}; check "
                f"the learning rate (optim.lr, schedule.warmup_steps), train.clip_grad_norm, and the data and "
                f"the task's loss for NaN/inf.{self.precision.non_finite_hint}{log}")

    # -- evaluation ------------------------------------------------------------------
    def evaluate(self, split: str = "val", model: nn.Module | None = None, prefix: str | None = None,
                 kind: str = "periodic") -> dict[str, float]:
        """Loss and task metrics over one split, merged across processes; the training
        RNG streams are left untouched.

        Args:
            split: ``"val"`` or ``"test"``.
            model: the model to evaluate (default: the raw, trained one).
            prefix: result key prefix (default ``split``).
            kind: ``"periodic"`` or ``"final"`` (given to the task in its ``EvalContext``).
        """
        ctx = EvalContext(split, self.step, kind, self.counts.evaluations, prefix or "")
        out_dir = self.run_dir / "eval" if self.run_dir is not None else None
        with preserved_rng(), gathered(self.model), self.log.messages(type(self.task).__module__):  # fsdp: full weights
            loader = self.val_loader if split == "val" else \
                split_loader(self.task, split, self.tcfg, False, self.rank, self.world_size, self.device)
            return evaluate_loader(self.task, model or self.model, loader, self.device, self.precision, ctx,
                                   out_dir, media=lambda items: self.log.media(items, self.step))

    def _evaluate_and_track(self) -> tuple[dict[str, float], float]:
        """Evaluate raw (and EMA) weights; update best value and early-stopping count."""
        kind = "final" if self.step == self.total_steps else "periodic"
        results = self.evaluate("val", kind=kind)
        if self.ema is not None:
            results.update(self.evaluate("val", self.ema.module, prefix="val_ema", kind=kind))
        self.counts.evaluations += 1
        improved = self.best.update(results, self.step)  # the key was checked against the declared ones at set-up
        epoch = self.step / self.steps_per_epoch if self.steps_per_epoch else None  # None: no epochs
        self.log.metrics({"step": self.step, "epoch": epoch, "split": "val", **results,
                          "time": self.counts.wall_time()})
        if self._curves is not None:
            self._curves.update(final=kind == "final")
        shown = "  ".join(f"{k}={v:.4f}" for k, v in results.items())
        self.log.echo(f"step {self.step}/{self.total_steps}  {shown}" + ("  (best)" if improved else ""))
        return results, results[self.best.key]

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (:func:`~tk.core.engine.trainer_state.trainer_state`); collective."""
        return trainer_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (:func:`~tk.core.engine.trainer_state.load_trainer_state`)."""
        load_trainer_state(self, state)

    def _resume(self, state: dict[str, Any], path: str | Path) -> None:
        """Continue from a checkpoint read before the assembly (its task state restored there)."""
        self.load_state_dict(state)
        self._saved_step = self.step
        if self.checkpoints is not None:
            abandoned = self.checkpoints.prepare_resume(self.step)
            self._rewound = abandoned is not None
            if abandoned is not None:
                self.log.echo(f"resuming from step {self.step}: the later checkpoints moved to {abandoned}")
        self.log.truncate_after(self.step)
        self._resumed_at = self.step
        self.log.echo(f"resumed from {path} at step {self.step}")

    def save_checkpoint(self, metric: float | None = None) -> Path | None:
        """Save the current step's checkpoint (rank 0 writes; all call it); ``metric`` competes for ``best.pt``."""
        state = self.state_dict()
        shards = state.pop("shards", None)
        if shards is not None and self.run_dir is not None:  # fsdp: every process writes its shards
            state[SHARDS_KEY] = save_shards(self.run_dir / "checkpoints", self.step, shards, self.is_main,
                                            reuse=self._saved_step == self.step)
        self.log.flush()  # the loggers' buffers: what the checkpoint covers survives a kill
        path = None if self.checkpoints is None else \
            self.checkpoints.save(state, step=self.step, metric=metric, mode=self.best.mode)
        self._saved_step = self.step
        if path is not None:  # `tk runs` shows how far a running (or killed) run got
            self._status("running")
        return path

    # -- the loop --------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to ``total_steps`` (or an early stop), evaluating and checkpointing.

        Returns:
            The last evaluation's results (``{"val/loss": ..., "val/top1": ...}``).

        Raises:
            TrainingInterrupted: SIGINT/SIGTERM arrived; a checkpoint was saved first.
        """
        self.log.echo(run_summary(self.cfg, self.model, self.device, self.total_steps, self.steps_per_epoch,
                                  self.world_size, ema=self.ema is not None))
        bar = ProgressBar(self.total_steps, self.step) if self.tcfg.progress and self.is_main else None
        self.log.attach_bar(bar)
        try:
            self._status("running")
            if self.is_main and self.run_dir is not None:
                self.log.add_loggers(open_loggers(self.cfg, self.run_dir, self._resumed_at, self._rewound))
            self.counts.start_clock()
            with stop_signals(self.stop, rearm=self.world_size == 1):
                results = self._loop(bar)
            # fsdp: the full weights gathered to rank 0 (a collective); else the module (LoRA written merged)
            weights = full_model_state(self.model) if is_fsdp(self.model) else self.model
            if self.checkpoints is not None:  # the headers name the task and step of the weights
                meta = tk_metadata(self.cfg.task, self.step)
                for name, module in (("model", weights), ("model_ema", self.ema and self.ema.module)):
                    if module is not None:
                        export_safetensors(module, self.run_dir / f"{name}.safetensors", meta)
        except TrainingInterrupted:
            self._status("interrupted")
            raise
        except Exception as e:
            self._save_after_failure()
            self._status("failed", error=str(e) if isinstance(e, TkError) else f"{type(e).__name__}: {e}")
            raise
        finally:
            if bar is not None:
                bar.close()
            self.log.attach_bar(None)
            self.log.close()
        self._status("finished")
        return results

    def _status(self, state: str, **fields: Any) -> None:
        """``status.json`` (rank 0): how far the run got and how it ended, for ``tk runs``."""
        self.log.status(state, self.step, total_steps=self.total_steps, task=self.cfg.task,
                        recipe=self.cfg.name or self.cfg.source, **fields)

    def _loop(self, bar: ProgressBar | None) -> dict[str, float]:
        results: dict[str, float] = {}
        window: list[dict[str, float]] = []
        clock = Throughput()
        t = self.tcfg
        if self.total_steps == 0:  # train.max_steps=0: the starting model (e.g. a loaded encoder), evaluated and saved
            results, metric = self._evaluate_and_track()
            self.save_checkpoint(metric)
        while self.step < self.total_steps:
            self._in_update = True
            window.append(self.train_step())
            self._in_update = False
            if bar is not None:
                bar.update()
            if self.step % t.log_every == 0 or self.step == self.total_steps:
                self._log_train(window, clock, bar)
                window = []
            evaluated, metric = eval_due(self.step, self.total_steps, t.eval_every, self.steps_per_epoch), None
            if evaluated or (t.save_every and self.step % t.save_every == 0):
                paused = time.perf_counter()
                if evaluated and self.step == self.total_steps:
                    self.save_checkpoint()  # the work is safe even if the final evaluation fails
                if evaluated:
                    results, metric = self._evaluate_and_track()
                self.save_checkpoint(metric)
                clock.exclude(time.perf_counter() - paused)  # throughput counts training time only
            if self.stop.due(self.world_size):
                path = self.save_checkpoint() if self._saved_step != self.step else None
                path = path or (self.checkpoints.latest() if self.checkpoints else None)
                raise TrainingInterrupted(self.stop.agreed, self.step, path)
            if evaluated and self.best.should_stop:
                self.log.echo(self.best.stop_message(self.step))
                break
        return results

    def _save_after_failure(self) -> None:
        """After an error outside an update (evaluation, logging), save the completed
        updates if they are not saved yet (``checkpoints.latest()`` then names them).
        Inside an update (a half-accumulated step) or with several processes (saving is a
        collective the others may never reach) the last regular checkpoint stands."""
        if self.checkpoints is None or self.world_size > 1 or self._in_update or not self.save_on_failure():
            return
        if self._saved_step != self.step and self.step > 0:
            try:
                self.save_checkpoint()
            except Exception:  # noqa: BLE001 - the original error matters more; keep the older checkpoint
                pass

    def _log_train(self, window: list[dict[str, float]], clock: Throughput, bar: ProgressBar | None) -> None:
        record, eta = train_record(window, clock, self.step, self.steps_per_epoch, self.total_steps,
                                   self.batches.pop_wait())
        record.update(self.precision.log_record(), items_seen=self.counts.items_seen, time=self.counts.wall_time())
        self.log.metrics(record)
        self.log.echo(train_line(record, self.total_steps, eta), console=bar is None)
        self.batches.note_starvation(record["data_wait"])
        if bar is not None:
            bar.show(record["loss"], record["lr"], record["items_per_s"])
