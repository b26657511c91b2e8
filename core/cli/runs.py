"""``tk runs [DIR]``: the run directories under a folder, one line each: task, recipe,
status, steps, best metric and its step, wall time.

A run's status comes from its ``status.json`` (written by the engine): ``finished``,
``failed`` (with the error), ``interrupted`` (SIGINT/SIGTERM), or ``running``, which
means *interrupted* when its process is gone (SIGKILL, a crash of the machine).
"interrupted at step N" names the step a ``--resume`` continues from (the last
checkpoint). Runs from before ``status.json`` existed are judged by their files.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import yaml

from tk.core.errors import TkError
from tk.core.run.loggers import read_records, scalars
from tk.core.run.run_dir import RUN_MARKER
from tk.core.run.runlog import STATUS_FILE, format_duration

__all__ = ["find_runs", "describe_run", "list_runs", "format_runs"]

MAX_DEPTH = 4  # run dirs are looked for this many folders below DIR


def find_runs(root: str | Path) -> list[Path]:
    """Run dirs (folders holding tk's ``.tk-run`` marker) at or under ``root``, sorted.

    Raises:
        TkError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise TkError(f"tk runs: {str(root)!r} is not a directory; pass the folder that holds your runs")
    found = []
    for folder, dirs, files in os.walk(root):
        depth = len(Path(folder).relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and depth < MAX_DEPTH and d not in
                         ("checkpoints", "artifacts", "eval", "media", "tensorboard", "wandb"))
        if RUN_MARKER in files:
            found.append(Path(folder))
            dirs[:] = []  # a run dir holds no other runs
    return sorted(found)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(status: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``status`` still runs (None: another machine's)."""
    if status.get("host") != socket.gethostname() or not isinstance(status.get("pid"), int):
        return None
    try:
        os.kill(status["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that id
        return True
    return True


def describe_run(run_dir: Path) -> dict[str, Any]:
    """One run's line of ``tk runs`` as a dict (the ``--json`` form)."""
    status = _json(run_dir / STATUS_FILE)
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    train = config.get("train") or {}
    records = read_records(run_dir / "metrics.jsonl")
    last_ckpt = (_json(run_dir / "checkpoints" / "checkpoints.json").get("last") or {}).get("step")
    last_step = max((r.get("step", 0) for r in records), default=0)
    state = status.get("status")
    if state is None:  # a run from before status.json: judge by the files
        state = "finished" if (run_dir / "model.safetensors").is_file() else "interrupted"
    elif state == "running" and _alive(status) is False:
        state = "interrupted"  # killed: its process is gone
    step = last_step if state == "running" else status.get("step", last_step)
    if state == "interrupted":
        step = last_ckpt if last_ckpt is not None else 0  # where --resume continues
    best_key = train.get("best_metric") or "val/loss"
    mode = train.get("best_mode") or ("min" if best_key.endswith("loss") else "max")
    best = best_of(records, best_key, mode)
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    return {
        "run": str(run_dir), "task": status.get("task") or config.get("task"), "recipe": status.get("recipe"),
        "status": state, "step": step, "total_steps": status.get("total_steps", train.get("max_steps")),
        "last_checkpoint": last_ckpt, "error": status.get("error"),
        "best_metric": best_key, "best_value": best[1] if best else None, "best_step": best[0] if best else None,
        "wall_time_s": max(times) if times else None, "updated": status.get("updated"),
        "_records": records,
    }


def best_of(records: list[dict[str, Any]], metric: str, mode: str) -> tuple[int, float] | None:
    """(step, value) of the best ``metric`` (logger name) in ``records``; None if never logged."""
    points = [(r["step"], v) for r in records for k, v in scalars(r).items() if k == metric and not math.isnan(v)]
    if not points:
        return None
    return min(points, key=lambda p: p[1]) if mode == "min" else max(points, key=lambda p: p[1])


def list_runs(root: str | Path, sort: str | None = None) -> list[dict[str, Any]]:
    """Every run under ``root`` (:func:`describe_run`), by path; with ``sort`` (a metric
    such as ``val/top1``) best first (lowest first for a ``*loss`` metric), runs that
    never logged it last.

    Raises:
        TkError: ``root`` is not a directory, or ``sort`` was logged by none of the runs.
    """
    runs = [describe_run(d) for d in find_runs(root)]
    if sort:
        mode = "min" if sort.endswith("loss") else "max"
        for run in runs:
            best = best_of(run["_records"], sort, mode)
            run["sort_metric"], run["sort_value"], run["sort_step"] = sort, *(best[::-1] if best else (None, None))
        if runs and all(r["sort_value"] is None for r in runs):
            logged = sorted({k for r in runs for rec in r["_records"] for k in scalars(rec)})
            raise TkError(f"--sort: no run under {str(root)!r} logged {sort!r}; logged: {', '.join(logged)}")
        sign = 1 if mode == "min" else -1
        runs.sort(key=lambda r: (r["sort_value"] is None, sign * (r["sort_value"] or 0.0)))
    for run in runs:
        del run["_records"]
    return runs


def _status_text(run: dict[str, Any]) -> str:
    if run["status"] == "interrupted":
        return f"interrupted at step {run['step']}"
    if run["status"] == "failed":
        return f"failed at step {run['step']}"
    return run["status"]


def format_runs(runs: list[dict[str, Any]], root: str | Path) -> str:
    """The ``tk runs`` table (paths relative to ``root``); failed runs' errors below it."""
    if not runs:
        return f"no runs under {root} (a run dir holds a {RUN_MARKER} marker)"
    sort = runs[0].get("sort_metric")
    header = ["run", "task", "recipe", "status", "steps", "best", "at step", "wall time"]
    rows = []
    for r in runs:
        metric, value, at = (sort, r["sort_value"], r["sort_step"]) if sort else \
            (r["best_metric"], r["best_value"], r["best_step"])
        total = r["total_steps"]
        steps = f"{r['step']}/{total}" if total else str(r["step"])
        rows.append([_relative(r["run"], root), str(r["task"] or "?"), str(r["recipe"] or "?"), _status_text(r),
                     steps, f"{metric} {value:.4f}" if value is not None else "-",
                     str(at) if at is not None else "-",
                     format_duration(r["wall_time_s"]) if r["wall_time_s"] is not None else "-"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines += [f"{_relative(r['run'], root)}: {r['error']}" for r in runs if r["status"] == "failed" and r["error"]]
    return "\n".join(lines)


def _relative(path: str, root: str | Path) -> str:
    try:
        rel = Path(path).relative_to(root)
        return str(rel) if str(rel) != "." else str(path)
    except ValueError:
        return path
