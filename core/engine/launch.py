"""Starting a training run: the run directory, torch.distributed set-up from torchrun's
environment, and multi-process launch through torch's own launcher.

``tk run RECIPE --nproc-per-node N`` re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m tk run RECIPE ...``;
``torchrun ... -m tk run RECIPE`` (e.g. on several machines) reaches :func:`run_training`
with ``WORLD_SIZE`` set, which joins the process group.
torchrun: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from tk.core.engine.device import preflight
from tk.core.engine.distributed import cleanup, init_distributed
from tk.core.engine.precision import check_precision
from tk.core.engine.train import Trainer
from tk.core.errors import TkError
from tk.core.recipe import load_config

__all__ = ["check_run_dir", "prepare_run_dir", "launch_command", "launch", "run_training"]


def check_run_dir(output_dir: str, resume: bool, overwrite: bool) -> Path:
    """The checks of :func:`prepare_run_dir`, touching nothing.

    Raises:
        TkError: the dir holds files and neither flag is given; --resume without a
            previous run; or --overwrite would delete a folder that is not a tk run dir.
    """
    run_dir = Path(output_dir)
    if resume and overwrite:
        raise TkError("--resume and --overwrite exclude each other; pick one")
    if run_dir.exists() and not run_dir.is_dir():
        raise TkError(f"output_dir {str(run_dir)!r} is a file, not a directory; choose another output_dir=...")
    occupied = run_dir.exists() and any(run_dir.iterdir())
    if resume and not occupied:
        raise TkError(f"--resume: {str(run_dir)!r} holds no previous run; drop --resume to start one")
    if not resume and occupied and not overwrite:
        raise TkError(f"output_dir {str(run_dir)!r} is not empty (a previous run?); pass --resume to "
                      f"continue it, --overwrite to replace it, or set output_dir=<new dir>")
    if not resume and occupied and overwrite and not (run_dir / "config.yaml").exists():
        raise TkError(f"--overwrite: {str(run_dir)!r} does not look like a tk run dir (no config.yaml); "
                      f"refusing to delete it, choose another output_dir=...")
    return run_dir


def prepare_run_dir(output_dir: str, resume: bool, overwrite: bool) -> Path:
    """Make sure a run never silently overwrites a previous one; create the dir.

    Raises:
        TkError: see :func:`check_run_dir`.
    """
    run_dir = check_run_dir(output_dir, resume, overwrite)
    if not resume and overwrite and run_dir.exists() and any(run_dir.iterdir()):
        # Set the old run aside rather than deleting it: it is deleted once the new run
        # has passed set-up, and put back if set-up fails (see run_training).
        aside = set_aside_path(run_dir)
        if aside.exists():
            shutil.rmtree(aside)
        run_dir.rename(aside)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def set_aside_path(run_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the previous run until the new one has started."""
    return run_dir.parent / f".{run_dir.name}.tk-overwritten"


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
                 echo: Callable[[str], None] = print) -> dict[str, float]:
    """``tk run``: load the recipe, prepare the run dir (rank 0), train, return the last
    evaluation. Inside torchrun (``WORLD_SIZE > 1``) every process calls this.

    Raises:
        TkError: config, machine or run-dir problems (before anything is written).
        tk.core.engine.train.TrainingInterrupted: SIGINT/SIGTERM; a checkpoint was saved.
    """
    cfg, task_cls = load_config(recipe, list(overrides))
    dist = _init_distributed(cfg.train.device)
    try:
        # device and precision problems, before anything is written
        problem = check_precision(cfg.train.precision, dist.device) if dist is not None else None
        if dist is None:
            preflight(cfg)
        elif problem:
            raise TkError(problem)
        is_main = dist is None or dist.rank == 0

        existed = Path(cfg.output_dir).exists()

        def prepare() -> Path:
            run_dir = prepare_run_dir(cfg.output_dir, resume=resume, overwrite=overwrite)
            if not resume:
                (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
            return run_dir

        run_dir = _on_main_first(dist, prepare) or Path(cfg.output_dir)
        if is_main:
            procs = f" ({dist.world_size} processes)" if dist else ""
            echo(f"run dir: {run_dir}{procs}")
        try:
            trainer = Trainer(cfg, task_cls, run_dir, dist,
                              resume_from=run_dir / "checkpoints" / "last.pt" if resume else None)
        except TkError:  # e.g. missing data: leave no half-made run dir behind
            if is_main and not resume:
                _discard_new_run(run_dir, existed)
            raise
        if is_main:
            shutil.rmtree(set_aside_path(run_dir), ignore_errors=True)  # the overwritten run
        if resume and is_main:  # the settings the run continues with (e.g. a longer max_steps)
            (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        return trainer.fit()
    finally:
        if dist is not None:
            cleanup()
