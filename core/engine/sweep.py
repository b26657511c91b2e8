"""``tk sweep``: many trials of one recipe on an Optuna study.

Each trial is a normal ``tk run`` in its own process (``SWEEP_DIR/trial_NNNN``, its sampled
keys in its ``config.yaml``), so ``tk eval``, ``predict`` and ``export`` work on any trial and a
trial can use ``--nproc-per-node``. The run reports every evaluation to the study from inside
the engine (:mod:`tk.core.engine.sweep_trial`), where the pruner can stop it.

The study lives in ``SWEEP_DIR/study.journal`` (Optuna's journal file storage; no server) or
in ``--storage`` (a journal file on a shared file system, or an RDB URL): every worker running
the same command on it runs distinct trials of one study until ``--trials`` have started.
A trial is claimed by a lock file its worker holds while it runs; ``--resume`` takes over the
trials whose worker died (continuing the run from its checkpoint, or starting it again).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from tk.core.engine.search_space import SearchSpace
from tk.core.engine.study import STUDY_NAME, build_pruner, build_sampler, open_storage, open_study, trial_handle
from tk.core.engine.sweep_trial import TRIAL_ENV
from tk.core.errors import TkError

try:
    import fcntl
except ImportError:  # Windows: no locks (one worker per sweep dir)
    fcntl = None

__all__ = ["Sweep", "SWEEP_FILE", "run_sweep", "trial_rows"]

WORKER_ENV = "TK_SWEEP_WORKER"  # set in the --jobs worker processes: they print no summary of their own
SWEEP_FILE = "sweep.yaml"  # what the sweep runs: recipe, overrides, space, objective
JOURNAL_FILE = "study.journal"


@dataclass
class Sweep:
    """One sweep: the recipe and its overrides, the space, the objective and where it lives."""

    recipe: str
    overrides: list[str]
    space: SearchSpace
    metric: str
    direction: str
    trials: int
    sweep_dir: Path
    storage: str
    nproc_per_node: int | None = None

    def definition(self) -> dict[str, Any]:
        """What makes two sweep commands the same study (``sweep.yaml``)."""
        return {"recipe": self.recipe, "overrides": list(self.overrides), "space": self.space.raw,
                "metric": self.metric, "direction": self.direction, "storage": self.storage, "study": STUDY_NAME}

    def trial_spec(self, number: int) -> dict[str, Any]:
        return {"storage": self.storage, "study": STUDY_NAME, "trial": number, "metric": self.metric,
                "pruner": self.space.pruner}


@contextmanager
def _flock(path: Path, block: bool = True) -> Iterator[bool]:
    """An exclusive lock on ``path`` (False when ``block`` is False and another process holds it)."""
    if fcntl is None:
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _claim_path(sweep: Sweep, number: int) -> Path:
    return sweep.sweep_dir / ".claims" / f"trial_{number:04d}.lock"


def _claim(sweep: Sweep, number: int) -> IO | None:
    """Hold trial ``number``'s claim (an open file under ``flock``, released when it is closed
    or this process dies); None when another live worker holds it."""
    path = _claim_path(sweep, number)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    if fcntl is not None:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
    return f


# -- the sweep ----------------------------------------------------------------------------------
def prepare_sweep_dir(sweep: Sweep, resume: bool) -> Any:
    """Create or join the study; ``sweep.yaml`` says what a sweep dir runs.

    Raises:
        TkError: the dir runs another sweep, holds something else, or (``resume``) no sweep.
    """
    import optuna

    path = sweep.sweep_dir / SWEEP_FILE
    mine = sweep.definition()
    if path.is_file():
        theirs = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        changed = sorted(k for k in mine if k != "storage" and theirs.get(k) != mine[k])
        if changed:
            raise TkError(f"{sweep.sweep_dir} holds another sweep ({', '.join(changed)} differ from its "
                          f"{SWEEP_FILE}); give the same recipe, overrides and space to continue it, or --dir NEW")
    elif resume:
        raise TkError(f"--resume: {sweep.sweep_dir} holds no sweep ({SWEEP_FILE} missing); drop --resume to start one")
    elif sweep.sweep_dir.exists() and any(sweep.sweep_dir.iterdir()):
        raise TkError(f"--dir {sweep.sweep_dir} exists and is not a sweep dir; give an empty or new folder")
    created = not sweep.sweep_dir.exists()
    sweep.sweep_dir.mkdir(parents=True, exist_ok=True)
    try:  # the storage first: one that cannot be reached leaves nothing behind (docs/sweeps.md)
        storage = open_storage(sweep.storage)
    except TkError:
        if created and not any(sweep.sweep_dir.iterdir()):
            sweep.sweep_dir.rmdir()
        raise
    if not path.is_file():
        path.write_text(yaml.safe_dump(mine, sort_keys=False), encoding="utf-8")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name=STUDY_NAME, storage=storage,
                               sampler=build_sampler(sweep.space), pruner=build_pruner(sweep.space.pruner),
                               direction=sweep.direction, load_if_exists=True)


def _next_trial(sweep: Sweep, study: Any, resume: bool) -> tuple[int, dict[str, Any], bool, IO] | None:
    """(number, params, resumed, claim) of the trial to run next, its claim held, or None when
    ``--trials`` have started. Asking and claiming happen under one lock, so no other worker
    on this machine sees the new trial unclaimed."""
    import optuna

    with _flock(sweep.sweep_dir / ".ask.lock"):
        trials = study.get_trials(deepcopy=False)
        if resume:
            for t in trials:
                if t.state == optuna.trial.TrialState.RUNNING and (claim := _claim(sweep, t.number)) is not None:
                    return t.number, dict(t.params), True, claim  # its worker is gone
        if len(trials) >= sweep.trials:
            return None
        # a sampler seeded by the trial's number: workers on other machines draw other values, reproducibly
        study.sampler = build_sampler(sweep.space, sweep.space.seed + len(trials))
        trial = study.ask()
        params = {p.key: p.suggest(trial) for p in sweep.space.searched}
        trial.set_user_attr("run_dir", str(sweep.sweep_dir / f"trial_{trial.number:04d}"))
        return trial.number, params, False, _claim(sweep, trial.number)


def _command(sweep: Sweep, number: int, params: dict[str, Any], resumed: bool) -> list[str]:
    run_dir = sweep.sweep_dir / f"trial_{number:04d}"
    cmd = [sys.executable, "-m", "tk", "run", sweep.recipe, *sweep.overrides, *sweep.space.overrides(params),
           f"output_dir={run_dir}", f"train.best_metric={sweep.metric}", "train.progress=false"]
    if sweep.nproc_per_node:
        cmd += ["--nproc-per-node", str(sweep.nproc_per_node)]
    return cmd + (["--resume", "auto"] if resumed else [])


def _outcome(sweep: Sweep, study: Any, number: int) -> tuple[str, float | None]:
    """(state, objective) of a trial whose run ended: its best reported value; pruned if the
    pruner stopped it; failed without a finite value."""
    frozen = study.get_trials(deepcopy=False)[number]
    values = [v for v in frozen.intermediate_values.values() if math.isfinite(v)]
    best = (max if sweep.direction == "maximize" else min)(values) if values else None
    if "pruned_at" in frozen.user_attrs:
        return "pruned", best
    return ("complete", best) if best is not None else ("failed", None)


def run_worker(sweep: Sweep, study: Any, resume: bool, echo: Callable[[str], None]) -> None:
    """Run trials until ``sweep.trials`` have started (and, with ``resume``, no trial is orphaned).

    Raises:
        KeyboardInterrupt: the sweep was interrupted (its trial keeps its checkpoint; ``--resume``).
    """
    import optuna

    logs = sweep.sweep_dir / "logs"
    logs.mkdir(exist_ok=True)
    while (picked := _next_trial(sweep, study, resume)) is not None:
        number, params, resumed, claim = picked
        with claim:
            start = time.monotonic()
            env = {**os.environ, TRIAL_ENV: json.dumps(sweep.trial_spec(number))}
            with open(logs / f"trial_{number:04d}.log", "ab") as log:
                proc = subprocess.Popen(_command(sweep, number, params, resumed), env=env, stdout=log, stderr=log)
                try:
                    code = proc.wait()
                except KeyboardInterrupt:  # the trial got the signal too: it saves a checkpoint and stops
                    proc.wait()
                    raise
            if code in (130, 143):
                raise KeyboardInterrupt
            shown = " ".join(f"{k}={_short(v)}" for k, v in params.items())
            if code == 0:
                state, value = _outcome(sweep, study, number)
            else:
                state, value = "failed", None
            # GridSampler.after_trial calls study.stop() once the grid is done, which raises outside
            # study.optimize (and would lose the trial's state): tell through a sampler without hooks
            study.sampler = optuna.samplers.RandomSampler()
            if state == "complete":
                study.tell(number, value)
            elif state == "pruned":
                study.tell(number, state=optuna.trial.TrialState.PRUNED)
            else:
                reason = _last_line(logs / f"trial_{number:04d}.log") if code else \
                    f"no finite {sweep.metric} was reported"
                trial_handle(study, number).set_user_attr("error", reason)
                study.tell(number, state=optuna.trial.TrialState.FAIL)
            result = f"{sweep.metric}={value:.4f}" if value is not None else (reason if state == "failed" else "")
            echo(f"trial {number}{' (resumed)' if resumed else ''}: {shown} -> {state} {result} "
                 f"({time.monotonic() - start:.0f} s)".rstrip())


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _last_line(path: Path) -> str:
    """The last non-empty line of a trial's log (tk's one-line error)."""
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1] if lines else "the trial's process failed without a message"


def run_sweep(sweep: Sweep, resume: bool, jobs: int, worker_args: list[str], echo: Callable[[str], None]) -> Any:
    """Prepare the study, run ``jobs`` workers (this process and ``jobs - 1`` others running
    ``tk sweep`` with ``worker_args``), return the study."""
    study = prepare_sweep_dir(sweep, resume)
    if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:  # K trials at once share the cores, not thrash on them
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // (jobs * (sweep.nproc_per_node or 1)))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the workers and their trials inherit it
        echo(f"{jobs} trials at a time on {cores} CPU cores: {threads} thread(s) per trial process "
             f"(set OMP_NUM_THREADS to choose)")
    others = [subprocess.Popen([sys.executable, "-m", "tk", "sweep", *worker_args, "--jobs", "1"],
                               env={**os.environ, WORKER_ENV: "1"}) for _ in range(jobs - 1)]
    try:
        run_worker(sweep, study, resume, echo)
    finally:
        for proc in others:
            proc.wait()
    return study


def trial_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """The trials of the sweep in ``sweep_dir``, best first: number, state, value, params, run dir."""
    definition = yaml.safe_load((sweep_dir / SWEEP_FILE).read_text(encoding="utf-8"))
    study = open_study(definition)
    sign = -1 if definition["direction"] == "maximize" else 1
    rows = [{"trial": t.number, "state": t.state.name.lower(), "value": t.value, "params": dict(t.params),
             "run_dir": t.user_attrs.get("run_dir"), "error": t.user_attrs.get("error")}
            for t in study.get_trials(deepcopy=False)]
    return sorted(rows, key=lambda r: (r["value"] is None, sign * (r["value"] or 0.0), r["trial"]))
