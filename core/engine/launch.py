"""Starting a training run: the run directory and torch.distributed set-up from torchrun's
environment.

``tk run RECIPE --nproc-per-node N`` runs torch's elastic agent in-process
(:mod:`tk.core.engine.agent`), whose workers run ``tk run RECIPE ...``; ``torchrun ... -m tk
run RECIPE`` (e.g. on several machines) reaches :func:`run_training` the same way, with
``WORLD_SIZE`` set, which joins the process group. ``--resume auto`` lets
``torchrun --max-restarts N`` restart a preempted job with the same command line.
torchrun: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shlex
import shutil
from pathlib import Path
from typing import Callable, Literal

from tk.core.distributed import barrier, cleanup, init_distributed, ranks_not_seeing
from tk.core.engine.checks import run_checks
from tk.core.engine.sweep_trial import trial_reporting
from tk.core.engine.train import Trainer
from tk.core.errors import RunError, TkError
from tk.core.recipe import load_config
from tk.core.run.checkpoint import CheckpointManager, CheckpointReadError, intact_checkpoints
from tk.core.run.run_dir import (
    RUN_MARKER,
    RunDirLock,
    auto_resume_plan,
    check_run_dir,
    drop_set_aside,
    is_run_dir,
    prepare_run_dir,
    set_aside_path,
    unusable_dir,
    write_run_marker,
)
from tk.core.training.signals import TrainingInterrupted

__all__ = ["RUN_MARKER", "FAULT_ENV", "is_run_dir", "write_run_marker", "check_run_dir", "auto_resume_plan",
           "prepare_run_dir", "set_aside_path", "drop_set_aside", "run_training"]

FAULT_ENV = "TK_FAULT_AT_STEP"  # for tests only: see _fault_hook


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise TkError(f"environment variable WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


def _on_main_first(dist, fn: Callable[[], object]) -> object:
    """Run ``fn`` on rank 0 while the other ranks wait; a TkError there is raised on
    every rank (so none hangs at a collective). Returns ``fn()``'s result on every rank
    (a decision rank 0 took, e.g. what ``--resume auto`` does, before anyone wrote)."""
    error, result = None, None
    if dist is None or dist.rank == 0:
        try:
            result = fn()
        except TkError as e:
            error = str(e)
    if dist is not None:
        import torch.distributed

        box = [error, result]
        torch.distributed.broadcast_object_list(box, src=0)
        error, result = box
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


def run_training(recipe: str, overrides: list[str], resume: bool | Literal["auto"] = False, overwrite: bool = False,
                 echo: Callable[[str], None] = print, resume_from: str | None = None) -> dict[str, float]:
    """``tk run``: load the recipe, prepare the run dir (rank 0), train, return the last
    evaluation. Inside torchrun (``WORLD_SIZE > 1``) every process calls this.

    Args:
        resume: continue the run in ``output_dir``; ``"auto"``: continue it if there is
            one, else start one (see :func:`auto_resume_plan`). Rank 0 decides before
            any process writes, and tells the others.
        resume_from: continue from this checkpoint file instead of the run dir's
            ``checkpoints/last.pt`` (implies ``resume``).

    Raises:
        TkError: config, machine or run-dir problems (before anything is written).
        RunError: a problem found after training started (one line; exit code 1).
        tk.core.engine.train.TrainingInterrupted: SIGINT/SIGTERM; a checkpoint was saved.
    """
    auto = resume == "auto"
    if auto and (overwrite or resume_from is not None):
        raise TkError(f"--resume auto and {'--overwrite' if overwrite else '--resume-from'} exclude each other; "
                      f"pick one")
    resume = resume or resume_from is not None
    fault = _fault_hook()
    cfg, task_cls = load_config(recipe, list(overrides))
    dist = _init_distributed(cfg.train.device)
    lock = RunDirLock()  # held by the process that prepares the run dir, until this returns
    try:
        # every check tk validate makes too, before anything is written (--resume auto: rank 0's view of the dir)
        main_first = dist is None or dist.rank == 0
        fresh = not resume or (auto and main_first and auto_resume_plan(cfg.output_dir) != "resume")
        run_checks(cfg, task_cls, fresh, dist)
        is_main = dist is None or dist.rank == 0
        existed = _exists(Path(cfg.output_dir))

        def prepare() -> tuple[Path, bool]:
            lock.acquire(Path(cfg.output_dir))  # a live run there: refused before anything moves
            plan = auto_resume_plan(cfg.output_dir) if auto else None
            resuming = plan == "resume" if auto else bool(resume)
            run_dir = prepare_run_dir(cfg.output_dir, resume=resuming, overwrite=overwrite or plan == "restart")
            try:
                if not resuming:
                    write_run_marker(run_dir)
                    lock.acquire(run_dir)  # the new run's own marker
                    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
            except OSError as e:
                _discard_new_run(run_dir, existed)
                raise unusable_dir(run_dir, e) from e
            if plan is not None:
                echo(_AUTO_SAYS[plan].format(run_dir=run_dir, aside=set_aside_path(run_dir)))
            return run_dir, resuming

        run_dir, resume = _on_main_first(dist, prepare)
        if is_main:
            procs = f" ({dist.world_size} processes)" if dist else ""
            echo(f"run dir: {run_dir}{procs}")
        # the command a message suggests again: on one machine, with the same number of processes
        one_node = dist is not None and os.environ.get("LOCAL_WORLD_SIZE") == str(dist.world_size)
        procs_flag = ["--nproc-per-node", str(dist.world_size)] if one_node else []
        command = shlex.join(["tk", "run", str(recipe), *overrides, *procs_flag])
        with trial_reporting():  # a tk sweep trial: evaluations reported to its study (pruning)
            results = _train(cfg, task_cls, run_dir, dist, resume, resume_from, existed, command, fault)
        if dist is not None:  # leave together: a rank tearing gloo down while a peer still uses it can abort
            barrier()
        return results
    finally:
        lock.release()
        if dist is not None:
            cleanup()


_AUTO_SAYS = {
    "new": "--resume auto: no previous run in {run_dir}; starting a new one",
    "resume": "--resume auto: continuing the run in {run_dir} from its last checkpoint",
    "restart": "--resume auto: the run in {run_dir} stopped before its first checkpoint; starting it again "
               "(its files are kept in {aside} until the new run's first checkpoint)",
}


def _fault_hook() -> Callable[[Path], None] | None:
    """For tests of restarts: with ``TK_FAULT_AT_STEP=N`` set, the process ends abruptly
    (``os._exit(1)``: no clean-up, no further save, as a preempted one would) right after
    the checkpoint of update N is saved (by rank 0, which saves them); only in a job's first attempt (torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` unset or 0), so that a restarted job runs to the end.
    None when the variable is unset or the job was restarted.

    Raises:
        TkError: the variable is not a positive integer.
    """
    value = os.environ.get(FAULT_ENV, "")
    if not value or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    if not value.isdigit() or int(value) < 1:
        raise TkError(f"environment variable {FAULT_ENV} must be a positive integer (an update), got {value!r}")
    at = int(value)

    def fault(path: Path) -> None:
        if path.name == f"step_{at:08d}.pt":
            os.write(2, f"{FAULT_ENV}={at}: exiting abruptly after the checkpoint of step {at}\n".encode())
            os._exit(1)

    return fault


def _train(cfg, task_cls, run_dir: Path, dist, resume: bool, resume_from: str | None, existed: bool,
           command: str, fault: Callable[[Path], None] | None = None) -> dict[str, float]:
    """Build the trainer and fit; until the first checkpoint, any failure puts back
    the run that ``--overwrite`` set aside (and discards the new one). ``fault``: the
    save hook of :func:`_fault_hook`, if any."""
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
        if dist is not None:
            _check_shared(run_dir, resume_from if resume else None, cfg.train.strategy)
        try:
            last = run_dir / "checkpoints" / "last.pt"
            trainer = Trainer(cfg, task_cls, run_dir, dist,
                              resume_from=(Path(resume_from) if resume_from else last) if resume else None)
        except CheckpointReadError as e:
            if not resume or resume_from is not None:
                raise
            raise _unreadable_last(e, run_dir, command) from e
        # the settings the run continues with (e.g. a longer max_steps), and the model as built (the
        # shape a model.pretrained_from source gave it): what eval, predict and export rebuild
        model_cfg = trainer.task.model_cfg if "model" in cfg.sections else None
        built = dataclasses.replace(cfg, sections={**cfg.sections, "model": model_cfg}) if model_cfg else cfg
        if is_main and (resume or built.to_dict() != cfg.to_dict()):
            (run_dir / "config.yaml").write_text(built.to_yaml(), encoding="utf-8")
        if is_main and trainer.checkpoints is not None:
            trainer.checkpoints.add_save_hook(on_save)
            trainer.save_on_failure = lambda: not aside_kept
            if fault is not None:
                trainer.checkpoints.add_save_hook(fault)
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


def _check_shared(run_dir: Path, resume_from: str | None, strategy: str) -> None:
    """Every process must see the run dir rank 0 prepared (and a ``--resume-from`` file's
    folder): FSDP writes every process's shards there, a resume reads the checkpoint on every
    process, and a process that cannot see the task files (a trained tokenizer) would build its
    own, which need not match rank 0's.

    Raises:
        TkError: (on every process) some process does not see one of them.
    """
    for folder in [run_dir] + ([Path(resume_from).resolve().parent] if resume_from else []):
        blind = ranks_not_seeing(folder)
        if blind:
            why = "every process reads and writes its checkpoint shards there" if strategy == "fsdp" else \
                "every process reads the task files and the checkpoint to resume from there"
            name = "output_dir" if folder == run_dir else "--resume-from's folder"
            raise TkError(f"{name} {folder} is not one folder shared by all processes: {', '.join(blind)} cannot "
                          f"see a file rank 0 wrote there; {why}: use a folder on a filesystem every node mounts "
                          f"(NFS, Lustre, ...)")


def _unreadable_last(e: CheckpointReadError, run_dir: Path, command: str) -> TkError:
    """``--resume`` found ``last.pt`` unreadable: name the intact checkpoints and the
    command that continues from the newest of them."""
    intact = intact_checkpoints(run_dir / "checkpoints")
    if not intact:
        return TkError(f"{e.problem}; no intact checkpoint in {run_dir / 'checkpoints'}: start again with --overwrite")
    names = ", ".join(p.name for p in intact)
    newest = next((p for p in intact if p.name.startswith("step_")), intact[0])  # the most work kept
    return TkError(f"{e.problem}; intact checkpoints: {names}; resume from one with `{command} --resume-from {newest}`")


def _run_failure(e: BaseException, trainer: Trainer, run_dir: Path, restored: bool, command: str) -> BaseException:
    """The error a failure after set-up becomes: a one-line :class:`RunError` that says
    what was kept (the trainer has saved the completed updates where it could). A
    signal's stop and a Ctrl-C pass through."""
    if not isinstance(e, Exception) or isinstance(e, (RunError, TrainingInterrupted)):
        return e
    manager = CheckpointManager(run_dir / "checkpoints")  # what is on disk: any rank may be the one that fails
    latest = manager.latest()
    fix = "free disk space" if isinstance(e, OSError) else "fix the problem"
    if restored:
        kept = f"the previous run in {run_dir} was put back unchanged"
    elif latest is not None:
        step = manager.info.get("last", {}).get("step", "?")
        kept = f"the last checkpoint {latest} (step {step}) is intact; {fix} and continue with `{command} --resume`"
    else:
        kept = f"no checkpoint had been saved yet; {fix} and start again with --overwrite"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = e.filename or run_dir
        return RunError(f"disk full (No space left on device) while writing {where} at step {trainer.step}; "
                        f"{kept}")
    what = str(e) if isinstance(e, TkError) else f"{type(e).__name__}: {e}"
    debug = "" if isinstance(e, TkError) else "; run with --debug for the full traceback"
    return RunError(f"{what} (at step {trainer.step}; {kept}{debug})")
