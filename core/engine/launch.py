"""Starting a training run: the run directory, torch.distributed set-up from torchrun's
environment, and multi-process launch through torch's own launcher.

``tk run RECIPE --nproc-per-node N`` re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m tk run RECIPE ...``;
``torchrun ... -m tk run RECIPE`` (e.g. on several machines) reaches :func:`run_training`
with ``WORLD_SIZE`` set, which joins the process group.
torchrun: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import tk
from tk.core.distributed import barrier, cleanup, init_distributed
from tk.core.engine.checkpoint import CheckpointReadError, intact_checkpoints
from tk.core.engine.device import check_logger_packages, preflight
from tk.core.engine.precision import check_precision
from tk.core.engine.signals import TrainingInterrupted
from tk.core.engine.train import Trainer
from tk.core.errors import RunError, TkError
from tk.core.recipe import load_config

__all__ = ["RUN_MARKER", "is_run_dir", "write_run_marker", "check_run_dir", "prepare_run_dir",
           "set_aside_path", "drop_set_aside", "launch_command", "launch", "run_training"]

RUN_MARKER = ".tk-run"  # written by tk into every run dir it creates; --overwrite deletes nothing else


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` is a run dir that tk created (it holds :data:`RUN_MARKER`)."""
    try:
        return json.loads((folder / RUN_MARKER).read_text(encoding="utf-8")).get("tk_run") is True
    except (OSError, ValueError, AttributeError):
        return False


def write_run_marker(run_dir: Path) -> None:
    """Mark ``run_dir`` as tk's own: a small JSON with the run's id, tk's version and
    the time it was created."""
    marker = {"tk_run": True, "run_id": uuid.uuid4().hex, "tk_version": tk.__version__,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (run_dir / RUN_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def _unusable(run_dir: Path, e: OSError) -> TkError:
    why = e.strerror or type(e).__name__
    return TkError(f"output_dir {str(run_dir)!r} cannot be used: {why}; choose another output_dir=...")


def check_run_dir(output_dir: str, resume: bool, overwrite: bool) -> Path:
    """The checks of :func:`prepare_run_dir`, touching nothing.

    Raises:
        TkError: the dir holds files and neither flag is given; --resume without a
            previous run; --overwrite of a folder that tk did not create (no
            :data:`RUN_MARKER`); or the path cannot be a directory.
    """
    run_dir = Path(output_dir)
    if resume and overwrite:
        raise TkError("--resume and --overwrite exclude each other; pick one")
    try:
        if run_dir.exists() and not run_dir.is_dir():
            raise TkError(f"output_dir {str(run_dir)!r} is a file, not a directory; choose another output_dir=...")
        occupied = run_dir.exists() and any(run_dir.iterdir())
    except OSError as e:  # a name too long, a parent that is a file, no permission
        raise _unusable(run_dir, e) from e
    if resume and not occupied:
        raise TkError(f"--resume: {str(run_dir)!r} holds no previous run; drop --resume to start one")
    if resume and not is_run_dir(run_dir) and not (run_dir / "checkpoints").is_dir():
        raise TkError(f"--resume: {str(run_dir)!r} holds no tk run (no {RUN_MARKER} marker, no checkpoints/); "
                      f"set output_dir= to the run to continue")
    if not resume and occupied and not overwrite:
        raise TkError(f"output_dir {str(run_dir)!r} is not empty (a previous run?); pass --resume to "
                      f"continue it, --overwrite to replace it, or set output_dir=<new dir>")
    if not resume and occupied and overwrite and not is_run_dir(run_dir):
        raise TkError(f"--overwrite: {str(run_dir)!r} was not made by `tk run` (no {RUN_MARKER} marker); "
                      f"refusing to delete it, choose another output_dir=... (or delete it yourself)")
    return run_dir


def prepare_run_dir(output_dir: str, resume: bool, overwrite: bool) -> Path:
    """Make sure a run never silently overwrites a previous one; create the dir.

    With ``--overwrite`` the previous run is moved to :func:`set_aside_path`; it is
    deleted by :func:`drop_set_aside` once the new run has saved its first checkpoint,
    and put back if the new run fails before that.

    Raises:
        TkError: see :func:`check_run_dir`; or the dir cannot be created.
    """
    run_dir = check_run_dir(output_dir, resume, overwrite)
    try:
        if not resume and overwrite and run_dir.exists() and any(run_dir.iterdir()):
            aside = set_aside_path(run_dir)
            if aside.exists():  # left by an earlier --overwrite that was killed before it could clean up
                if any((run_dir / "checkpoints").glob("step_*.pt")):
                    shutil.rmtree(aside)  # that run got as far as a checkpoint: the set-aside one is older
                else:
                    shutil.rmtree(run_dir)  # it saved nothing: the set-aside run is still the last complete one
            if run_dir.exists():
                run_dir.rename(aside)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable(run_dir, e) from e
    return run_dir


def set_aside_path(run_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the previous run until the new one has saved a checkpoint."""
    return run_dir.parent / f".{run_dir.name}.tk-overwritten"


def drop_set_aside(run_dir: Path) -> None:
    """Delete the run that ``--overwrite`` set aside (no-op if there is none): called
    once the new run has written its first checkpoint."""
    aside = set_aside_path(run_dir)
    shutil.rmtree(aside, ignore_errors=True)
    if aside.exists():
        warnings.warn(f"could not delete the overwritten run {aside}; delete it by hand", stacklevel=2)


def launch_command(nproc_per_node: int, tk_args: list[str]) -> list[str]:
    """The torchrun command line that runs ``tk <tk_args>`` in ``nproc_per_node``
    processes on this machine (``--standalone``: a local rendezvous on a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", "tk", *tk_args]


def launch(nproc_per_node: int, tk_args: list[str]) -> int:
    """Run ``tk <tk_args>`` in ``nproc_per_node`` processes through torchrun and wait.

    SIGTERM is passed on to torchrun (which passes it to the workers: they save a
    checkpoint and stop); Ctrl-C reaches the workers from the terminal directly.

    Returns:
        torchrun's exit code; 143 (128 + SIGTERM) after a passed-on SIGTERM.
    """
    proc = subprocess.Popen(launch_command(nproc_per_node, tk_args))
    forwarded = []

    def forward(signum, _frame):
        forwarded.append(signum)
        proc.send_signal(signum)

    old_term = signal.signal(signal.SIGTERM, forward)
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = proc.wait()
        return 128 + forwarded[0] if forwarded else code
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise TkError(f"environment variable WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


def _on_main_first(dist, fn: Callable[[], object]) -> object:
    """Run ``fn`` on rank 0 while the other ranks wait; a TkError there is raised on
    every rank (so none hangs at a collective). Returns ``fn()``'s result on rank 0."""
    error, result = None, None
    if dist is None or dist.rank == 0:
        try:
            result = fn()
        except TkError as e:
            error = str(e)
    if dist is not None:
        import torch.distributed

        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise TkError(error)
    return result


def _init_distributed(device: str):
    """Join torchrun's process group when ``WORLD_SIZE > 1``; None otherwise."""
    if _world_size() <= 1:
        return None
    kind = None if device == "auto" else ("cuda" if device.startswith("cuda") else device)
    return init_distributed(kind)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name too long: check_run_dir says so
        return False


def _discard_new_run(run_dir: Path, existed: bool) -> None:
    """Remove what a run that failed during set-up wrote, and put back the run that
    ``--overwrite`` had set aside (if any)."""
    aside = set_aside_path(run_dir)
    if not existed or aside.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        if aside.exists():
            aside.rename(run_dir)
        return
    for child in run_dir.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def run_training(recipe: str, overrides: list[str], resume: bool = False, overwrite: bool = False,
                 echo: Callable[[str], None] = print, resume_from: str | None = None) -> dict[str, float]:
    """``tk run``: load the recipe, prepare the run dir (rank 0), train, return the last
    evaluation. Inside torchrun (``WORLD_SIZE > 1``) every process calls this.

    Args:
        resume_from: continue from this checkpoint file instead of the run dir's
            ``checkpoints/last.pt`` (implies ``resume``).

    Raises:
        TkError: config, machine or run-dir problems (before anything is written).
        RunError: a problem found after training started (one line; exit code 1).
        tk.core.engine.train.TrainingInterrupted: SIGINT/SIGTERM; a checkpoint was saved.
    """
    resume = resume or resume_from is not None
    cfg, task_cls = load_config(recipe, list(overrides))
    dist = _init_distributed(cfg.train.device)
    try:
        # device and precision problems, before anything is written
        problem = check_precision(cfg.train.precision, dist.device) if dist is not None else None
        if dist is None:
            preflight(cfg)
        else:
            check_logger_packages(cfg)
            if problem:
                raise TkError(problem)
        if not resume:  # e.g. model.pretrained_from: a missing or unreadable source, before anything is written
            fresh_problems = task_cls.check_fresh_run(cfg)
            if fresh_problems:
                raise TkError("; ".join(fresh_problems))
        is_main = dist is None or dist.rank == 0
        existed = _exists(Path(cfg.output_dir))

        def prepare() -> Path:
            run_dir = prepare_run_dir(cfg.output_dir, resume=resume, overwrite=overwrite)
            try:
                if not resume:
                    write_run_marker(run_dir)
                    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
            except OSError as e:
                _discard_new_run(run_dir, existed)
                raise _unusable(run_dir, e) from e
            return run_dir

        run_dir = _on_main_first(dist, prepare) or Path(cfg.output_dir)
        if is_main:
            procs = f" ({dist.world_size} processes)" if dist else ""
            echo(f"run dir: {run_dir}{procs}")
        command = shlex.join(["tk", "run", str(recipe), *overrides])
        results = _train(cfg, task_cls, run_dir, dist, resume, resume_from, existed, command)
        if dist is not None:  # leave together: a rank tearing gloo down while a peer still uses it can abort
            barrier()
        return results
    finally:
        if dist is not None:
            cleanup()


def _train(cfg, task_cls, run_dir: Path, dist, resume: bool, resume_from: str | None, existed: bool,
           command: str) -> dict[str, float]:
    """Build the trainer and fit; until the first checkpoint, any failure puts back
    the run that ``--overwrite`` set aside (and discards the new one)."""
    is_main = dist is None or dist.rank == 0
    trainer, fitting = None, False
    # the run --overwrite set aside: kept (and put back on failure) until the first checkpoint
    aside_kept = is_main and not resume and set_aside_path(run_dir).exists()

    def on_save(_path: Path) -> None:
        nonlocal aside_kept
        if aside_kept:
            drop_set_aside(run_dir)
            aside_kept = False

    try:
        try:
            last = run_dir / "checkpoints" / "last.pt"
            trainer = Trainer(cfg, task_cls, run_dir, dist,
                              resume_from=(Path(resume_from) if resume_from else last) if resume else None)
        except CheckpointReadError as e:
            if not resume or resume_from is not None:
                raise
            raise _unreadable_last(e, run_dir, command) from e
        if resume and is_main:  # the settings the run continues with (e.g. a longer max_steps)
            (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        if is_main and trainer.checkpoints is not None:
            trainer.checkpoints.add_save_hook(on_save)
            trainer.save_on_failure = lambda: not aside_kept
        fitting = True
        results = trainer.fit()
    except BaseException as e:
        restored = aside_kept
        if is_main and not resume and (restored or not fitting):
            _discard_new_run(run_dir, existed)
        failure = _run_failure(e, trainer, run_dir, restored, command) if fitting else e
        if failure is e:
            raise
        raise failure from e
    if aside_kept:
        drop_set_aside(run_dir)  # a run that ends without any checkpoint still replaces the old one
    return results


def _unreadable_last(e: CheckpointReadError, run_dir: Path, command: str) -> TkError:
    """``--resume`` found ``last.pt`` unreadable: name the intact checkpoints and the
    command that continues from the newest of them."""
    intact = intact_checkpoints(run_dir / "checkpoints")
    if not intact:
        return TkError(f"{e}; no intact checkpoint in {run_dir / 'checkpoints'}: start again with --overwrite")
    names = ", ".join(p.name for p in intact)
    newest = next((p for p in intact if p.name.startswith("step_")), intact[0])  # the most work kept
    return TkError(f"{e}; intact checkpoints: {names}; resume from one with `{command} --resume-from {newest}`")


def _run_failure(e: BaseException, trainer: Trainer, run_dir: Path, restored: bool, command: str) -> BaseException:
    """The error a failure after set-up becomes: a one-line :class:`RunError` that says
    what was kept (the trainer has saved the completed updates where it could). A
    signal's stop and a Ctrl-C pass through."""
    if not isinstance(e, Exception) or isinstance(e, (RunError, TrainingInterrupted)):
        return e
    latest = trainer.checkpoints.latest() if trainer.checkpoints is not None else None
    fix = "free disk space" if isinstance(e, OSError) else "fix the problem"
    if restored:
        kept = f"the previous run in {run_dir} was put back unchanged"
    elif latest is not None:
        step = trainer.checkpoints.info.get("last", {}).get("step", "?")
        kept = f"the last checkpoint {latest} (step {step}) is intact; {fix} and continue with `{command} --resume`"
    else:
        kept = "no checkpoint had been saved yet; start again with --overwrite"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = e.filename or run_dir
        return RunError(f"disk full (No space left on device) while writing {where} at step {trainer.step}; "
                        f"{kept}")
    what = str(e) if isinstance(e, TkError) else f"{type(e).__name__}: {e}"
    debug = "" if isinstance(e, TkError) else "; run with --debug for the full traceback"
    return RunError(f"{what} (at step {trainer.step}; {kept}{debug})")
