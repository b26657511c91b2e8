"""What a run writes while it trains: ``train.log``, ``metrics.jsonl``, ``metrics.csv``,
``status.json``, media and the console progress bar (main process only)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tqdm.auto import tqdm

from tk.core.media import Media, write_media_file
from tk.core.run.loggers import CsvLogger, JsonlLogger, Logger

if TYPE_CHECKING:
    from torch import nn

STATUS_FILE = "status.json"  # how the run ended (or that it is running): read by `tk runs`

__all__ = ["STATUS_FILE", "RunLog", "ProgressBar", "Throughput", "window_record", "train_line", "format_duration",
           "format_bytes", "count_parameters"]


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1:02:05"``."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters); a parameter shared by two modules counts once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class _TaskMessages(logging.Handler):
    """Routes INFO+ records of the ``tk.*`` loggers (what a task or the engine reports while a
    run is assembled: a pretrained source loaded, adapters added) to the :class:`RunLog` inside
    whose :meth:`RunLog.messages` block they happen: ``train.log`` and the console. Outside
    one, warnings reach stderr as they would without this handler; INFO is dropped."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.target: RunLog | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.target is not None:
            self.target.echo(record.getMessage())
        elif record.levelno >= logging.WARNING and logging.lastResort is not None:
            logging.lastResort.handle(record)  # no run open: warnings reach stderr as without this handler


_MESSAGES = _TaskMessages()


class RunLog:
    """Writes ``train.log``, ``metrics.jsonl`` (and ``metrics.csv``), ``status.json`` and
    media in the run dir, passes every record to the run's other loggers
    (``tk.core.run.loggers``) and echoes human-readable lines to the console.

    ``metrics.jsonl`` is the record of truth (one JSON object per logged step or
    evaluation); it is always written.

    Args:
        run_dir: the run directory (None: log to the console only).
        enabled: False on non-main processes: write and print nothing.
        csv: also write ``metrics.csv`` (``csv`` in ``train.loggers``).
    """

    def __init__(self, run_dir: Path | None, enabled: bool = True, csv: bool = True) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir) if (run_dir is not None and enabled) else None
        self._bar: ProgressBar | None = None
        self.loggers: list[Logger] = []
        self._jsonl: JsonlLogger | None = None
        self._csv: CsvLogger | None = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = JsonlLogger(self.run_dir / "metrics.jsonl")
            self._csv = CsvLogger(self.run_dir / "metrics.csv", self._jsonl.records) if csv else None

    def attach_bar(self, bar: ProgressBar | None) -> None:
        """Route console lines through ``bar`` so they do not break it."""
        self._bar = bar

    def add_loggers(self, loggers: list[Logger]) -> None:
        """Send every later record and media item to ``loggers`` too (closed by :meth:`close`)."""
        self.loggers += loggers

    def echo(self, message: str, console: bool = True) -> None:
        """Append ``message`` to ``train.log``; print it unless ``console`` is False."""
        if not self.enabled:
            return
        if console:
            if self._bar is not None:
                self._bar.write(message)
            else:
                print(message, flush=True)
        if self.run_dir is not None:
            with open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
                f.write(message + "\n")

    def metrics(self, record: dict[str, Any]) -> None:
        """Append one record to ``metrics.jsonl`` (and ``metrics.csv``); pass it to every logger."""
        if self._jsonl is None:
            return
        for logger in (self._jsonl, self._csv, *self.loggers):
            if logger is not None:
                logger.log(record)

    def media(self, items: list[Media], step: int) -> None:
        """Write images/text of an evaluation under ``media/`` and pass them to every logger."""
        if self.run_dir is None or not items:
            return
        try:  # samples are for people to look at: a failure to write them must not cost the run
            for item in items:
                write_media_file(self.run_dir, item, step)
            for logger in self.loggers:
                logger.media(items, step)
        except Exception as e:
            warnings.warn(f"could not log the media of step {step}: {e}", stacklevel=2)

    def flush(self) -> None:
        """Flush the loggers' buffers (before a checkpoint: what it covers is then on disk)."""
        for logger in self.loggers:
            logger.flush()

    @contextlib.contextmanager
    def messages(self, *also: str) -> Iterator[None]:
        """Inside the block, the INFO+ messages of the ``tk.*`` loggers (what a task reports while
        a run is assembled or evaluated) and of the top-level package of each module named in
        ``also`` (a plugin's: ``logging.getLogger(__name__)`` anywhere in ``my_plugin``) are echoed
        here: ``train.log`` and the console."""
        if not self.enabled:
            yield
            return
        loggers = [logging.getLogger(name) for name in dict.fromkeys(("tk", *(m.split(".")[0] for m in also)))]
        before = (_MESSAGES.target, [lg.level for lg in loggers])
        _MESSAGES.target = self
        for lg in loggers:
            if _MESSAGES not in lg.handlers:
                lg.addHandler(_MESSAGES)
            lg.setLevel(logging.INFO)
        try:
            yield
        finally:
            _MESSAGES.target, levels = before
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)

    def close(self) -> None:
        """Close the loggers opened by :meth:`add_loggers`."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()

    def records(self) -> list[dict[str, Any]]:
        """All records of ``metrics.jsonl`` (a torn last line, from a killed process, is skipped)."""
        return self._jsonl.records() if self._jsonl is not None else []

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step``: on resume from the checkpoint of
        ``step``, a killed run's later records would otherwise appear twice."""
        if self._jsonl is None or not self._jsonl.path.is_file():
            return
        kept = self._jsonl.truncate_after(step)
        if self._csv is not None:
            self._csv.rewrite(kept, reset_fields=True)

    def status(self, state: str, step: int, **fields: Any) -> None:
        """Write ``status.json``: ``running``, ``finished``, ``interrupted`` or ``failed``
        at ``step``, with this process's id and host (``tk runs`` tells a killed run from
        a running one by them) and ``fields`` (e.g. ``error``, ``total_steps``)."""
        if self.run_dir is None:
            return
        path = self.run_dir / STATUS_FILE
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            previous = {}
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        status = {"status": state, "step": step, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": previous.get("started", now), "updated": now, **fields}
        tmp = path.with_name(f".{STATUS_FILE}.tmp")
        try:
            tmp.write_text(json.dumps(status) + "\n", encoding="utf-8")
            tmp.replace(path)
        except OSError as e:  # e.g. a full disk: the run's own error matters more
            warnings.warn(f"could not write {path}: {e}", stacklevel=2)


class ProgressBar:
    """A tqdm bar over optimizer updates showing loss, lr, throughput and ETA.

    Args:
        total: updates of the whole run.
        initial: updates already done (resume).
        unit: what throughput counts ("items": tokens or samples, whatever the task's
            ``num_items`` counts).
    """

    def __init__(self, total: int, initial: int = 0, unit: str = "items") -> None:
        self.unit = unit
        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                         mininterval=0.5)

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def show(self, loss: float, lr: float, items_per_s: float) -> None:
        """Refresh the numbers after the bar (called at log steps, where they are known)."""
        self._bar.set_postfix_str(f"loss={loss:.4f} lr={lr:.2e} {items_per_s:,.0f} {self.unit}/s", refresh=False)

    def write(self, message: str) -> None:
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()


class Throughput:
    """Items per second over the steps since the last :meth:`lap`."""

    def __init__(self) -> None:
        self._tic = time.perf_counter()
        self._excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (evaluation, checkpointing) out of the current lap."""
        self._excluded += seconds

    def lap(self, items: float) -> tuple[float, float]:
        """(items per second, training seconds) since the previous lap."""
        now = time.perf_counter()
        elapsed = max(now - self._tic - self._excluded, 1e-9)
        self._tic, self._excluded = now, 0.0
        return items / elapsed, elapsed


def window_record(window: list[dict[str, float]], clock: Throughput, waited: float = 0.0) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of the updates since the last log (``Trainer.train_step``
    results): item-weighted loss and task logs (both are per item in each update), last
    lr and grad norm, throughput, the share of the time spent waiting for batches (``waited``
    seconds), skipped updates; ``_seconds_per_step`` is for the ETA."""
    items = sum(s["items"] for s in window)
    items_per_s, elapsed = clock.lap(items)
    record: dict[str, Any] = {
        "split": "train", "loss": sum(s["loss"] * s["items"] for s in window) / max(items, 1.0),
        "lr": window[-1]["lr"], "grad_norm": window[-1]["grad_norm"], "items_per_s": items_per_s,
        "data_wait": min(waited / elapsed, 1.0), "skipped_steps": sum(s["skipped"] for s in window),
    }
    extra = {k for s in window for k in s} - {"loss", "grad_norm", "lr", "items", "skipped"}
    record.update({k: sum(s.get(k, 0.0) * s["items"] for s in window) / max(items, 1.0) for k in sorted(extra)})
    record["_seconds_per_step"] = elapsed / max(len(window), 1)
    return record


def train_record(window: list[dict[str, float]], clock: Throughput, step: int, steps_per_epoch: int | None,
                 total_steps: int, waited: float = 0.0) -> tuple[dict[str, Any], float]:
    """The training record at ``step`` (:func:`window_record` with step and epoch) and
    the estimated seconds to ``total_steps``."""
    record = {"step": step, "epoch": step / steps_per_epoch if steps_per_epoch else None,
              **window_record(window, clock, waited)}
    return record, (total_steps - step) * record.pop("_seconds_per_step")


def train_line(record: dict[str, Any], total_steps: int, eta: float) -> str:
    """One console/``train.log`` line for a training record."""
    skipped = f"  skipped {record['skipped_steps']:.0f}" if record["skipped_steps"] else ""
    return (f"step {record['step']}/{total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"grad_norm {record['grad_norm']:.3f}  {record['items_per_s']:,.0f} items/s  "
            f"eta {format_duration(eta)}{skipped}")


def run_summary(cfg: Any, model: Any, device: Any, total_steps: int, steps_per_epoch: int | None, world_size: int,
                ema: bool) -> str:
    """The line a run starts with: model size, device and precision, the update plan."""
    total, trainable = count_parameters(model)
    t = cfg.train
    extras = [name for name, on in (("EMA", ema), ("grad checkpointing", t.grad_checkpointing),
                                    ("torch.compile", t.compile), ("deterministic", t.deterministic),
                                    (f"overfitting {t.overfit_batches} batches", t.overfit_batches)) if on]
    return (f"task {cfg.task}: {type(model).__name__} with {total:,} parameters "
            f"({trainable:,} trainable, {format_bytes(4 * total)} in fp32) on {device} ({t.precision}); "
            f"{total_steps} updates of {t.batch_size} x {t.grad_accum} x {world_size} samples "
            f"({steps_per_epoch or 'no'} updates per epoch)" + (f"; {', '.join(extras)}" if extras else ""))
