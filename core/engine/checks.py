"""The checks ``tk run`` makes before it writes a run dir or builds a model, as one list that
``tk validate`` runs too: what validate says ok, run does not refuse a moment later for a
reason known before the data is read."""

from __future__ import annotations

import sys

from collections.abc import Callable
from typing import Any

from tk.core.errors import TkError
from tk.core.step import EvalContext
from tk.core.training.build import check_best_metric, check_keys
from tk.core.training.device import check_logger_packages, preflight
from tk.core.training.evaluate import metric_keys
from tk.core.training.precision import check_precision

__all__ = ["PRE_RUN_CHECKS", "run_checks"]


def _machine(cfg: Any, task_cls: type, dist: Any) -> None:
    """The device and precision on this machine (a launched process: its own device), and the
    logger packages."""
    if dist is None:
        preflight(cfg)
        return
    check_logger_packages(cfg)
    problem = check_precision(cfg.train.precision, dist.device)
    if problem:
        raise TkError(problem)


def _fresh_run(cfg: Any, task_cls: type, dist: Any) -> None:
    """The task's checks of a first start: e.g. model.pretrained_from and distill.teacher readable."""
    problems = task_cls.check_fresh_run(cfg)
    if problems:
        raise TkError("; ".join(problems))


def _best_metric(cfg: Any, task_cls: type, dist: Any) -> None:
    """``train.best_metric`` among the results every evaluation returns (the trainer checks it
    again after the task's set-up)."""
    if cfg.train.best_metric is None:
        return
    task = task_cls(cfg)
    try:
        metric_keys(task, EvalContext("val"))
    except TkError:
        raise
    except Exception as e:  # a task whose metrics need its set-up (e.g. the data's classes)
        declared = list(getattr(task_cls, "metric_names", ()) or ())
        if declared:  # what the task says its metrics log: checked here all the same
            check_keys(cfg.train.best_metric, ["val/loss", *(f"val/{k}" for k in declared)])
            return
        print(f"note: train.best_metric {cfg.train.best_metric!r} cannot be checked before the run starts: "
              f"{task_cls.__name__}.build_metrics needs the task's set-up ({type(e).__name__}: {e}); it is checked "
              f"after set-up (a task declares metric_names to have it checked here)", file=sys.stderr)
        return
    check_best_metric(task, cfg.train.best_metric, with_ema=cfg.train.ema_decay is not None)


PRE_RUN_CHECKS: list[tuple[str, Callable[[Any, type, Any], None], bool]] = [
    # (name, check, only on a fresh start)
    ("machine", _machine, False),
    ("fresh run", _fresh_run, True),
    ("best metric", _best_metric, False),
]


def run_checks(cfg: Any, task_cls: type, fresh: bool, dist: Any = None) -> None:
    """Run :data:`PRE_RUN_CHECKS` in order (``fresh``: also those of a first start).

    Raises:
        TkError: the first check that fails, one line naming the key and the fix.
    """
    for _name, check, fresh_only in PRE_RUN_CHECKS:
        if fresh or not fresh_only:
            check(cfg, task_cls, dist)
