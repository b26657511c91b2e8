"""Task files: what a task keeps in its run dir to rebuild itself (a tokenizer, a vocabulary,
a label map, normalisation statistics), found again by resume, eval and prediction."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tk.core.errors import TkError

__all__ = ["TaskFiles", "ARTIFACTS_DIR"]

ARTIFACTS_DIR = "artifacts"  # the folder under a run dir that holds task files


class TaskFiles:
    """The task-file folder of one run (``<run_dir>/artifacts``), owned by the engine.

    Names are relative to the folder, so a run dir that moved still finds its files.
    Writes are atomic (temp file + rename) and happen in ``Task.setup``, which the engine
    runs on rank 0 first; the other ranks then find the files written.

    Args:
        run_dir: the run directory, or None (nothing can be written or read).
    """

    def __init__(self, run_dir: str | Path | None) -> None:
        self.dir = Path(run_dir) / ARTIFACTS_DIR if run_dir is not None else None

    def path(self, name: str) -> Path:
        """Where task file ``name`` lives (it may not exist yet).

        Raises:
            TkError: the task has no run dir (e.g. ``tk summary``) or ``name`` leaves the folder.
        """
        if self.dir is None:
            raise TkError(f"task file {name!r}: this command has no run dir to keep task files in")
        path = (self.dir / name).resolve()
        if self.dir.resolve() not in path.parents:
            raise TkError(f"task file {name!r} must be a plain name inside the run's {ARTIFACTS_DIR}/ folder")
        return path

    def exists(self, name: str) -> bool:
        """Whether task file ``name`` was written (False without a run dir)."""
        return self.dir is not None and (self.dir / name).is_file()

    def read_text(self, name: str) -> str:
        """The text of task file ``name``.

        Raises:
            TkError: the file is missing (the run dir is incomplete or not a tk run).
        """
        path = self.path(name)
        if not path.is_file():
            raise TkError(f"task file {path} is missing; the run dir is incomplete: train it again "
                          f"with `tk run ... --overwrite`")
        return path.read_text(encoding="utf-8")

    def write_text(self, name: str, text: str) -> Path:
        """Write task file ``name`` atomically; returns its path."""
        return self.write_bytes(name, text.encode("utf-8"))

    def write_bytes(self, name: str, data: bytes) -> Path:
        """Write task file ``name`` atomically; returns its path."""
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)  # mkstemp's 0600 -> what open() gives (0644 usually)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def copy_to(self, dest_dir: str | Path) -> Path | None:
        """Copy every task file into ``dest_dir/artifacts`` (next to an exported model);
        returns that folder, or None when the run has no task files."""
        if self.dir is None or not self.dir.is_dir() or not any(self.dir.iterdir()):
            return None
        target = Path(dest_dir) / ARTIFACTS_DIR
        if target.resolve() != self.dir.resolve():
            # copyfile: the copies get the usual permissions, not those of the run's files
            shutil.copytree(self.dir, target, dirs_exist_ok=True, copy_function=shutil.copyfile)
        return target
