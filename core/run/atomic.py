"""Files that are either the old version or the complete new one, never half: temp file,
fsync, rename, fsync of the folder (what checkpoints and exported weights are written with)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir", "default_permissions"]

_NEARLY_FULL = 64 << 20  # bytes free below which a failed write is taken for a full disk


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder: Path) -> None:
    """Make a rename durable: fsync the directory entry (not possible on Windows)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_permissions(path: Path, folder: bool = False) -> None:
    """Give ``path`` the permissions a plain ``open``/``mkdir`` would (0644/0755 under the
    usual umask): ``tempfile`` makes its files 0600 and its folders 0700."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def atomic_write(path: Path, write) -> None:
    """Call ``write(file)`` on a temp file next to ``path``, fsync it, then rename it
    over ``path``: readers see the old file or the complete new one, never half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # name the file asked for, not the temp file
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        default_permissions(Path(tmp))
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None and e.errno is not None:  # a write to the open file: name it (e.g. disk full)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except RuntimeError as e:  # torch's zip writer reports a failed write as "[enforce fail at inline_container.cc]"
        Path(tmp).unlink(missing_ok=True)
        if "inline_container" not in str(e) and "PytorchStreamWriter" not in str(e):
            raise
        raise _write_error(path, e) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _write_error(path: Path, e: RuntimeError) -> OSError:
    """torch's writer failed: an OSError naming ``path``, ENOSPC when the disk is (nearly) full."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if free is not None and free < _NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    first = (str(e).splitlines() or [""])[0]
    return OSError(errno.EIO, f"write failed ({first[:120]})", str(path))
