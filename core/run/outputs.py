"""What a command writes outside a fresh run dir (``tk export -o``, ``tk average -o``,
``tk plot -o``): only where nothing a user owns is lost.

- Never, not even with ``--overwrite``: a run dir, anything inside a run's
  ``checkpoints/``, the current folder or a folder above it, or a folder that holds the
  run being read.
- An existing output is replaced only with ``--overwrite`` and only when this command
  wrote it: a folder holds the marker :data:`OUTPUT_MARKER` naming the command and the
  files it wrote (a folder that holds anything else is refused), a file carries the
  command's name inside it (safetensors metadata, a key of a ``.pt`` checkpoint, a PNG
  text chunk). An empty folder holds nothing to lose and is reused.
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
    if path.name == CHECKPOINTS_DIR and (path.parent / RUN_MARKER).is_file():
        return f"the checkpoints folder of the run {path.parent}"
    for above in path.parents:
        if above.name == CHECKPOINTS_DIR and (above.parent / RUN_MARKER).is_file():
            return f"inside the checkpoints of the run {above.parent}"
    return None


def written_by(path: Path) -> str | None:
    """The command that wrote ``path`` (``"tk export"``, ``"tk average"``, ``"tk plot"``),
    or None for a file or folder tk's commands did not write (or cannot be read). A file is
    recognised by its content (PNG, torch zip, safetensors), whatever its name."""
    try:
        if path.is_dir():
            marker = path / OUTPUT_MARKER
            return _read_marker(path).get(WRITTEN_BY) if marker.is_file() else None
        with open(path, "rb") as f:
            head = f.read(9)
        if head.startswith(b"\x89PNG"):
            from PIL import Image

            with Image.open(path) as image:
                return image.info.get(WRITTEN_BY)
        if head.startswith(b"PK"):  # torch.save's zip
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(state, dict):
                return None
            return state.get(WRITTEN_BY) or ("tk average" if "averaged_steps" in state else None)  # older averages
        if head[8:9] == b"{":  # safetensors: an 8-byte header length, then the JSON header
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return (f.metadata() or {}).get(WRITTEN_BY)
    except Exception:  # unreadable, damaged or of another kind: not something tk wrote
        return None
    return None


def _read_marker(folder: Path) -> dict:
    return json.loads((folder / OUTPUT_MARKER).read_text(encoding="utf-8"))


def _strangers(folder: Path) -> list[str]:
    """Files in an output folder that its marker does not list (added after the command wrote
    it): replacing the folder would delete them."""
    listed = set(_read_marker(folder).get("files", []))
    found = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())
    return [f for f in found if f not in listed and f != OUTPUT_MARKER]


def _what(path: Path, by: str | None) -> str:
    kind = "folder" if path.is_dir() else "file"
    return f"a {kind} {by} wrote" if by else f"a {kind} tk did not write"


def check_output(output: str | Path, command: str, overwrite: bool, sources: Sequence[Path] = (),
                 flag: str = "-o", folder: bool = False) -> Path:
    """Check that ``command`` (e.g. ``"tk export"``) may write ``output`` (a file, or with
    ``folder`` a folder); returns it.

    Raises:
        TkError: one line naming the path and what it is: a place no command writes over
            (with or without ``overwrite``), an existing output without ``overwrite``, one
            this command did not write, a folder of its own that holds files it did not
            write, a path under a file, or a path the system refuses.
    """
    text = str(output)
    out = Path(output)
    if not folder and text.endswith(("/", "\\")):
        raise TkError(f"{flag} {text}: names a folder; give a file name, e.g. {flag} {out / 'out'}")
    try:
        resolved = out.resolve()
        reserved = _reserved(resolved, sources)
        if reserved:
            raise TkError(f"{flag} {out}: is {reserved}; {command} never writes over it: pass another {flag}")
        blocker = next((p for p in [resolved, *resolved.parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None and blocker != resolved:
            raise TkError(f"{flag} {out}: {blocker} is a file, not a folder: pass another {flag}")
        if not out.exists() and not out.is_symlink():
            return out
        if folder and out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            return out  # an empty folder: nothing to lose
        by = written_by(out) if not out.is_symlink() else None
        if by != command:
            what = "a link" if out.is_symlink() else _what(out, by)
            raise TkError(f"{flag} {out}: exists and is {what}; {command} replaces only its own output: "
                          f"pass another {flag}")
        if not overwrite:
            raise TkError(f"{flag} {out}: exists ({command}'s output); pass --overwrite to replace it, or another "
                          f"{flag}")
        strangers = _strangers(out) if out.is_dir() else []
        if strangers:
            shown = ", ".join(strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
            raise TkError(f"{flag} {out}: holds {shown}, which {command} did not write; --overwrite would delete "
                          f"them: move them out or pass another {flag}")
    except OSError as e:  # a name too long, a folder that cannot be listed, ...
        raise TkError(f"{flag} {out}: {e.strerror or e}") from None
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


def write_output_folder(output: Path, command: str, fill: Callable[[Path], T], info: dict | None = None,
                        flag: str = "-o") -> T:
    """Write a folder for ``command``: ``fill(tmp)`` fills a temporary sibling of ``output``,
    the marker (with the list of files written) is added, then it is renamed into place (an
    existing ``output``, checked by :func:`check_output`, is moved aside first and removed
    last). On failure nothing is left behind, parent folders it created included. Returns
    what ``fill`` returns."""
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    tmp: Path | None = None
    old: Path | None = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
        default_permissions(tmp, folder=True)
        result = fill(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not p.is_dir())
        marker = {WRITTEN_BY: command, **(info or {}), "files": files}
        (tmp / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        if output.exists():
            old = output.with_name(f".{output.name}.{os.getpid()}.old")
            output.rename(old)
        tmp.rename(output)
        fsync_dir(output.parent)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not output.exists():
            old.rename(output)  # put the previous output back
        for folder in created:  # the parents this call made, innermost first
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(e, OSError) and not isinstance(e, TkError):
            raise TkError(f"{flag} {output}: cannot write there ({e.strerror or e})") from None
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    return result
