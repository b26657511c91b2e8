"""What a command writes outside a fresh run dir (``tk export -o``, ``tk average -o``,
``tk plot -o``): only where nothing a user owns is lost.

- Never, not even with ``--overwrite``: a run dir, anything inside a run's
  ``checkpoints/``, the current folder or a folder above it, or a folder that holds the
  run being read.
- An existing output is replaced only with ``--overwrite`` and only when this command
  wrote it: a folder holds the marker :data:`OUTPUT_MARKER` naming the command, a file
  carries the command's name inside it (safetensors metadata, a key of a ``.pt``
  checkpoint, a PNG text chunk). An empty folder holds nothing to lose and is reused.
- Folders are written beside their destination under a temporary name and renamed into
  place (files: :func:`tk.core.run.atomic.atomic_write`), with the umask's permissions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from tk.core.errors import TkError
from tk.core.run.atomic import default_permissions, fsync_dir
from tk.core.run.run_dir import RUN_MARKER

OUTPUT_MARKER = ".tk-output"  # in a folder a command wrote: {"written_by": "tk export", ...}
WRITTEN_BY = "tk_written_by"  # the key naming the command in a file it wrote (metadata, checkpoint)
CHECKPOINTS_DIR = "checkpoints"

__all__ = ["OUTPUT_MARKER", "WRITTEN_BY", "check_output", "check_merge", "written_by", "write_output_folder"]

T = TypeVar("T")


def _reserved(path: Path, sources: Sequence[Path]) -> str | None:
    """What ``path`` is when no command may write over it, else None."""
    cwd = Path.cwd().resolve()
    if path == cwd:
        return "the current folder"
    if path in cwd.parents:
        return "a folder that holds the current folder"
    for source in sources:
        source = source.resolve()
        if path == source:
            return "the run being read"
        if path in source.parents:
            return f"a folder that holds the run being read ({source})"
    if (path / RUN_MARKER).is_file():
        return "a tk run dir"
    for above in path.parents:
        if above.name == CHECKPOINTS_DIR and (above.parent / RUN_MARKER).is_file():
            return f"inside the checkpoints of the run {above.parent}"
    return None


def written_by(path: Path) -> str | None:
    """The command that wrote ``path`` (``"tk export"``, ``"tk average"``, ``"tk plot"``),
    or None for a file or folder tk's commands did not write (or cannot be read)."""
    try:
        if path.is_dir():
            marker = path / OUTPUT_MARKER
            return json.loads(marker.read_text(encoding="utf-8")).get(WRITTEN_BY) if marker.is_file() else None
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return (f.metadata() or {}).get(WRITTEN_BY)
        if path.suffix == ".pt":
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(state, dict):
                return None
            return state.get(WRITTEN_BY) or ("tk average" if "averaged_steps" in state else None)  # older averages
        if path.suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                return image.info.get(WRITTEN_BY)
    except Exception:  # unreadable, damaged or of another kind: not something tk wrote
        return None
    return None


def _what(path: Path) -> str:
    by = written_by(path)
    kind = "folder" if path.is_dir() else "file"
    return f"a {kind} {by} wrote" if by else f"a {kind} tk did not write"


def check_output(output: str | Path, command: str, overwrite: bool, sources: Sequence[Path] = (),
                 flag: str = "-o") -> Path:
    """Check that ``command`` (e.g. ``"tk export"``) may write ``output``; returns it.

    Raises:
        TkError: one line naming the path and what it is: a place no command writes over
            (with or without ``overwrite``), an existing output without ``overwrite``, or
            one this command did not write.
    """
    out = Path(output)
    resolved = out.resolve()
    reserved = _reserved(resolved, sources)
    if reserved:
        raise TkError(f"{flag} {out}: is {reserved}; {command} never writes over it: pass another {flag}")
    if not out.exists() and not out.is_symlink():
        return out
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return out  # an empty folder: nothing to lose
    by = written_by(out) if not out.is_symlink() else None
    if by != command:
        raise TkError(f"{flag} {out}: exists and is {_what(out) if not out.is_symlink() else 'a link'}; "
                      f"{command} replaces only its own output: pass another {flag}")
    if not overwrite:
        raise TkError(f"{flag} {out}: exists ({command}'s output); pass --overwrite to replace it, or another {flag}")
    return out


def check_merge(source: Path | None, target: Path, output: Path, flag: str = "-o") -> None:
    """Check that copying the folder ``source`` into ``target`` (the task files written
    beside ``output``) replaces nothing: every file already in ``target`` must be the same
    file in ``source``.

    Raises:
        TkError: ``target`` holds a file that the copy would replace or that ``source``
            lacks (another run's task files), naming it.
    """
    if source is None or not source.is_dir() or not any(source.iterdir()) or not target.exists() \
            or target.resolve() == source.resolve():
        return  # nothing is copied, or nothing is there to replace
    for path in sorted(target.rglob("*")):
        mine = source / path.relative_to(target)
        if path.is_file() and (not mine.is_file() or mine.read_bytes() != path.read_bytes()):
            raise TkError(f"{flag} {output}: {path} already exists and is not this run's; the task files are "
                          f"written beside the weights: pass an {flag} in a folder of its own")


def write_output_folder(output: Path, command: str, fill: Callable[[Path], T], info: dict | None = None) -> T:
    """Write a folder for ``command``: ``fill(tmp)`` fills a temporary sibling of ``output``,
    the marker is added, then it is renamed into place (an existing ``output``, checked by
    :func:`check_output`, is moved aside first and removed last). Nothing is left behind on
    failure. Returns what ``fill`` returns."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    old: Path | None = None
    try:
        default_permissions(tmp, folder=True)
        result = fill(tmp)
        (tmp / OUTPUT_MARKER).write_text(json.dumps({WRITTEN_BY: command, **(info or {})}) + "\n", encoding="utf-8")
        if output.exists():
            old = output.with_name(f".{output.name}.{os.getpid()}.old")
            output.rename(old)
        tmp.rename(output)
        fsync_dir(output.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not output.exists():
            old.rename(output)  # put the previous output back
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    return result
