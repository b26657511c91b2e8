"""The run directory: tk's marker, the checks before anything is written, ``--overwrite``'s
set-aside copy, and what ``--resume auto`` does with a folder. Light (no torch): ``tk runs``
and the launcher use it before the trainer is imported."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import tk
from tk.core.errors import TkError

if sys.platform != "win32":
    import fcntl
else:  # no flock: runs on Windows are not locked
    fcntl = None

__all__ = ["RUN_MARKER", "unusable_dir", "is_run_dir", "write_run_marker", "check_run_dir", "auto_resume_plan",
           "prepare_run_dir", "set_aside_path", "drop_set_aside", "RunDirLock"]

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


def unusable_dir(run_dir: Path, e: OSError) -> TkError:
    """The one-line error for an output_dir the OS refuses (a name too long, no permission)."""
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
        raise unusable_dir(run_dir, e) from e
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


def auto_resume_plan(output_dir: str) -> Literal["new", "resume", "restart"]:
    """What ``tk run --resume auto`` does with ``output_dir``, touching nothing.

    Returns:
        ``"new"``: the dir is absent or empty, a new run starts there.
        ``"resume"``: it holds a tk run with checkpoints (or exported weights), continued
        exactly as ``--resume`` does. ``"restart"``: it holds a tk run stopped before its
        first checkpoint, which is started again as ``--overwrite`` does (the old attempt
        is kept aside until the new one's first checkpoint, and put back if it fails first).

    Raises:
        TkError: a non-empty folder that tk did not make (``--resume``'s error), or a
            path that cannot be a run dir.
    """
    run_dir = Path(output_dir)
    try:
        occupied = run_dir.is_dir() and any(run_dir.iterdir())
    except OSError:
        occupied = True  # unreadable: check_run_dir says why
    if not occupied:
        check_run_dir(output_dir, resume=False, overwrite=False)  # a file, a bad name
        return "new"
    if is_run_dir(run_dir) and not _holds_results(run_dir):
        return "restart"
    check_run_dir(output_dir, resume=True, overwrite=False)
    return "resume"


def _holds_results(run_dir: Path) -> bool:
    """Whether a run dir holds work that starting again would throw away: a checkpoint,
    even a damaged one (``--resume`` then says what to do), or exported weights (a
    finished run whose checkpoints were deleted to save space)."""
    return any((run_dir / "checkpoints").rglob("*.pt")) or any(run_dir.glob("*.safetensors"))


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
        raise unusable_dir(run_dir, e) from e
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


class RunDirLock:
    """An exclusive lock on a run dir while one ``tk run`` uses it, so that a second run (a
    ``--resume`` typed while workers of a killed launcher still train, say) cannot move or
    overwrite its checkpoints. It is ``flock`` on the run's marker file (nothing is written);
    the OS releases it however the holding process ends, SIGKILL included."""

    def __init__(self) -> None:
        self._file = None

    def acquire(self, run_dir: Path) -> None:
        """Hold the lock of ``run_dir`` (released first if another one was held); nothing when
        the folder has no marker or its file system cannot lock.

        Raises:
            TkError: another process holds it (names its pid and host from ``status.json``).
        """
        if fcntl is None:
            return
        try:
            file = open(Path(run_dir) / RUN_MARKER, "rb")
        except OSError:  # no marker, or an unusable path: nothing to lock (the run dir checks say why)
            return
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise TkError(f"{run_dir} is in use by another tk run{_holder(Path(run_dir))}: wait for it to end or "
                          f"stop it, then run this again") from None
        except OSError:  # e.g. a file system without locks: run unlocked, as before locks existed
            file.close()
            return
        self.release()
        self._file = file

    def release(self) -> None:
        """Let the run dir go (also at the process's end, by the OS)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _holder(run_dir: Path) -> str:
    """" (pid N on HOST)" from the run's ``status.json``, if it says."""
    try:
        status = json.loads((run_dir / "status.json").read_text(encoding="utf-8"))
        return f" (pid {int(status['pid'])} on {status['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
