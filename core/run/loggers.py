"""Where a run's scalars and media go: ``train.loggers: [jsonl, csv, tensorboard, wandb]``.

Every record the engine logs (a training window or an evaluation, the same dicts as
``metrics.jsonl``) reaches each logger; all of them write from rank 0 only.

- ``jsonl``: ``metrics.jsonl``, the run's record of truth. Always written (resume,
  ``tk runs``, ``tk plot`` and ``curves.png`` read it), listed or not.
- ``csv``: ``metrics.csv``, the same records as a table.
- ``tensorboard``: event files in ``<run_dir>/tensorboard`` (``torch.utils.tensorboard``;
  ``pip install tk[tensorboard]``). ``tensorboard --logdir runs`` shows every run.
- ``wandb``: a Weights & Biases run (``pip install tk[wandb]``; ``WANDB_MODE=offline``
  needs no network), project ``train.wandb_project``, name ``train.wandb_name``, the
  resolved config as its config; files under ``<run_dir>/wandb``.

Scalar names (:func:`scalars`) are the record's keys, training keys under ``train/``:
``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/items_per_s``,
``train/skipped_steps``, the task's ``train/<log>``, ``val/loss``, ``val/top1``,
``val_ema/top1``; plus ``epoch``, ``items_seen`` and ``time`` (training seconds) from
training records. The step is the optimizer update.

Resume continues the same TensorBoard dir (``purge_step``: points after the resume
step that a killed run had written are dropped) and the same W&B run id (kept in
``<run_dir>/wandb.json`` with the last step sent; steps up to it are not sent again).
"""

from __future__ import annotations

import csv
import html
import importlib.util
import json
import math
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.core.media import Image, Media, Text

if TYPE_CHECKING:
    from tk.core.config import RunConfig

__all__ = ["LOGGER_NAMES", "missing_logger_packages", "scalars", "Logger", "JsonlLogger", "CsvLogger", "TensorBoardLogger",
           "WandbLogger", "open_loggers", "read_records"]

LOGGER_NAMES = ("jsonl", "csv", "tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # logger -> the package it needs (= the tk extra)
AXES = ("epoch", "items_seen", "time")  # x-axis quantities, logged from training records only
NOT_SCALARS = ("step", "split")


def package_available(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it: tensorboard takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_logger_packages(names: list[str]) -> list[str]:
    """Loggers whose package is not installed on this machine, each with the install line;
    checked before training (``tk run``, ``tk validate``), not when a finished run is loaded
    for ``tk eval``/``tk predict`` elsewhere."""
    problems = []
    for name in dict.fromkeys(names):
        package = PACKAGES.get(name)
        if package and not package_available(package):
            problems.append(f"train.loggers: {name!r} needs the {package} package, which is not installed; "
                            f"pip install 'tk[{name}]' (or pip install {package}), or drop {name} from train.loggers")
    return problems


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A ``metrics.jsonl`` record's scalars under their logger names (see the module doc)."""
    train = record.get("split") == "train"
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key in AXES:
            if train:
                out[key] = float(value)
        else:
            out[key if "/" in key or not train else f"train/{key}"] = float(value)
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line, from a killed process, is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Logger:
    """One destination of a run's records and media (rank 0 only).

    ``log`` gets every ``metrics.jsonl`` record (``step``, ``split`` and its numbers),
    ``media`` the evaluation's images and text; ``flush`` runs before each checkpoint is
    saved, so that what a checkpoint covers is on disk if the process is killed.
    """

    name = ""

    def log(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def media(self, items: list[Media], step: int) -> None:
        """Log images and text (default: ignore them)."""

    def flush(self) -> None:
        """Write what is buffered."""

    def close(self) -> None:
        """Flush and release files and processes."""


class JsonlLogger(Logger):
    """``metrics.jsonl``: one JSON object per record."""

    name = "jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.path)

    def truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Drop records of steps after ``step``; returns the kept ones."""
        kept = [r for r in self.records() if r.get("step", 0) <= step]
        if self.path.is_file():
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        return kept


class CsvLogger(Logger):
    """``metrics.csv``: the records as a table. Its columns are the union of all keys, so
    a record that brings a new key rebuilds the file from ``records`` (rare: the keys
    settle after the first evaluation).

    Args:
        path: the CSV file.
        records: returns every record so far (``metrics.jsonl``), for a rebuild.
    """

    name = "csv"

    def __init__(self, path: Path, records) -> None:
        self.path, self._records = path, records
        self._fields: list[str] = []
        if path.is_file():
            with open(path, newline="", encoding="utf-8") as f:
                self._fields = next(csv.reader(f), [])

    def log(self, record: dict[str, Any]) -> None:
        new = [k for k in record if k not in self._fields]
        if new:
            self._fields += new
            self.rewrite(self._records())
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self._fields, restval="").writerow(record)

    def rewrite(self, records: list[dict[str, Any]], reset_fields: bool = False) -> None:
        if reset_fields:
            self._fields = []
        for r in records:
            self._fields += [k for k in r if k not in self._fields]
        with open(self.path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self._fields, restval="")
            writer.writeheader()
            writer.writerows(records)


def _wait_past_newest_event_file(log_dir: Path) -> None:
    """Sleep until a new event file's name sorts after every file already in ``log_dir``.

    TensorBoard reads event files in name order and the name starts with the creation second
    (then host and pid): a resumed run started within the killed run's second could sort
    first, and its purge of the killed run's later steps would then be read before them.
    """
    seconds = [int(m.group(1)) for f in log_dir.glob("events.out.tfevents.*")
               if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", f.name))]
    if seconds:  # at most 2 s: a file stamped in the future (clock skew, copied run) must not stall the run
        time.sleep(min(2.0, max(0.0, max(seconds) + 1 - time.time())))


class TensorBoardLogger(Logger):
    """Scalars, images and text as TensorBoard events in ``<run_dir>/tensorboard``.

    Args:
        log_dir: the event-file folder.
        resumed_at: the step a resumed run continues from (events of later steps that a
            killed run wrote are purged); None for a fresh run.
    """

    name = "tensorboard"

    def __init__(self, log_dir: Path, resumed_at: int | None = None) -> None:
        # lazy: torch.utils.tensorboard imports the optional tensorboard package (seconds)
        from torch.utils.tensorboard import SummaryWriter

        purge = resumed_at + 1 if resumed_at is not None else None
        if resumed_at is not None:
            _wait_past_newest_event_file(Path(log_dir))
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for name, value in scalars(record).items():
            if math.isfinite(value):
                self.writer.add_scalar(name, value, step)

    def media(self, items: list[Media], step: int) -> None:
        for item in items:
            if isinstance(item, Image):
                formats = "HWC" if item.pixels.ndim == 3 else "HW"
                self.writer.add_image(item.tag, item.pixels, step, dataformats=formats)
            elif isinstance(item, Text):
                # TensorBoard renders text as markdown: a code block keeps line breaks and spacing
                self.writer.add_text(item.tag, "```\n" + item.text + "\n```", step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger(Logger):
    """A Weights & Biases run; its id and the last step sent live in ``<run_dir>/wandb.json``.

    Args:
        cfg: the resolved run config (uploaded as the W&B config; ``train.wandb_project``,
            ``train.wandb_name``).
        run_dir: the run dir (W&B's files go to ``<run_dir>/wandb``).
        resumed_at: the step a resumed run continues from; None for a fresh run.
        rewound: resumed from an earlier checkpoint than the latest (``--resume-from``): W&B
            cannot rewrite the abandoned steps, so the continuation is a new W&B run.
    """

    name = "wandb"

    def __init__(self, cfg: RunConfig, run_dir: Path, resumed_at: int | None = None, rewound: bool = False) -> None:
        import wandb  # lazy: optional package, slow to import

        self._wandb = wandb
        self.state_path = run_dir / "wandb.json"
        continues = resumed_at is not None and not rewound and self.state_path.is_file()
        saved = json.loads(self.state_path.read_text(encoding="utf-8")) if continues else {}
        run_id = saved.get("id") or uuid.uuid4().hex[:8]
        self.last_step = saved.get("last_step", -1)
        # steps up to it are in W&B already (W&B cannot take a step twice, nor go back)
        self.sent_before = self.last_step
        t = cfg.train
        self.run = wandb.init(project=t.wandb_project or "tk", name=t.wandb_name or run_dir.resolve().name,
                              id=run_id, resume="allow", dir=str(run_dir), config=cfg.to_dict(),
                              settings=wandb.Settings(**_quiet_settings(wandb)))
        self._save_state()

    def _save_state(self) -> None:
        self.state_path.write_text(json.dumps({"id": self.run.id, "last_step": self.last_step}) + "\n",
                                   encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step <= self.sent_before:  # a killed run sent it after its last checkpoint: W&B has it
            return
        values = {k: v for k, v in scalars(record).items() if math.isfinite(v)}
        if values:
            self.run.log(values, step=step)
        if step > self.last_step:
            self.last_step = step
            self._save_state()

    def media(self, items: list[Media], step: int) -> None:
        if step <= self.sent_before:
            return
        out: dict[str, Any] = {}
        for item in items:
            if isinstance(item, Image):
                out[item.tag] = self._wandb.Image(item.pixels, caption=item.caption or None)
            elif isinstance(item, Text):
                out[item.tag] = self._wandb.Html(f"<pre>{html.escape(item.text)}</pre>")
        if out:
            self.run.log(out, step=step)

    def close(self) -> None:
        self.run.finish()


def _quiet_settings(wandb) -> dict[str, Any]:
    """W&B settings that keep it off the console and skip what a training run does not
    need (git state, code upload, system-metrics sampling: seconds per start); only
    those the installed version knows."""
    wanted = {"console": "off", "silent": True, "disable_git": True, "save_code": False,
              "disable_job_creation": True, "x_disable_stats": True, "x_disable_machine_info": True}
    known = getattr(wandb.Settings, "model_fields", wanted)
    return {k: v for k, v in wanted.items() if k in known}


def open_loggers(cfg: RunConfig, run_dir: Path, resumed_at: int | None, rewound: bool = False) -> list[Logger]:
    """The external loggers of ``train.loggers`` (tensorboard, wandb), opened for a run;
    ``rewound``: resumed from a checkpoint before the latest one (the later steps are
    abandoned). ``jsonl`` and ``csv`` belong to :class:`tk.core.run.runlog.RunLog`."""
    out: list[Logger] = []
    names = cfg.train.loggers
    if "tensorboard" in names:
        out.append(TensorBoardLogger(run_dir / "tensorboard", resumed_at))
    if "wandb" in names:
        out.append(WandbLogger(cfg, run_dir, resumed_at, rewound))
    return out
