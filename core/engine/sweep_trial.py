"""The trial side of ``tk sweep``: a run started by a sweep (``TK_SWEEP_TRIAL`` set) reports
every evaluation's objective to the study and stops when the pruner says so.

Rank 0 talks to the study; the decision to stop is broadcast, so every process of a
multi-process trial stops after the same evaluation (the results are already the same on
every process: the engine reduces them before any listener sees them).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from tk.core.errors import TkError
from tk.core.training.best import evaluation_listener

__all__ = ["TRIAL_ENV", "trial_reporting"]

TRIAL_ENV = "TK_SWEEP_TRIAL"  # JSON: {"storage", "study", "trial", "metric", "pruner", "sweep_dir"}


class TrialReporter:
    """Reports ``metric`` at each evaluation to trial ``number`` of the study; returns the
    pruner's reason to stop, on every process."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.metric, self.number = spec["metric"], int(spec["trial"])
        self.pruning = spec.get("pruner", "none") != "none"
        self.trial = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            from tk.core.engine.study import open_study, trial_handle  # optuna: only a trial process needs it

            self.trial = trial_handle(open_study(spec), self.number)

    def __call__(self, step: int, results: Mapping[str, float]) -> str | None:
        stop = torch.zeros(1)
        if self.trial is not None:
            value = float(results[self.metric])
            if math.isfinite(value):
                self.trial.report(value, step)
                if self.pruning and self.trial.should_prune():
                    self.trial.set_user_attr("pruned_at", step)
                    stop[0] = 1
        if dist.is_initialized():  # rank 0's decision, everywhere
            backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            stop = stop.to(backend_device)
            dist.broadcast(stop, src=0)
        if stop.item():
            return f"pruned at step {step}: {self.metric}={results[self.metric]:.4f} is behind the study's other trials"
        return None


@contextmanager
def trial_reporting() -> Iterator[None]:
    """Inside a sweep's trial (``TK_SWEEP_TRIAL``): report evaluations; elsewhere nothing."""
    raw = os.environ.get(TRIAL_ENV)
    if not raw:
        with nullcontext():
            yield
        return
    try:
        spec = json.loads(raw)
    except ValueError as e:
        raise TkError(f"environment variable {TRIAL_ENV} is not the JSON tk sweep sets ({e}); unset it") from e
    reporter = None

    def listener(step: int, results: Mapping[str, float]) -> str | None:
        nonlocal reporter
        reporter = reporter or TrialReporter(spec)  # opened at the first evaluation, after the process group
        return reporter(step, results)

    with evaluation_listener(listener):
        yield
