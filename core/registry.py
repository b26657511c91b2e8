"""Task discovery through the ``tk.tasks`` entry-point group.

Built-in tasks register in ``setup.py`` exactly as third-party ones do in theirs
(as flake8 does with its own checkers). Discovery reads only package metadata;
``load_task`` imports exactly one plugin. A recipe may also name an uninstalled
local plugin as ``task: package.module:ClassName``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Iterable

from tk.core.errors import TkError

GROUP = "tk.tasks"


@dataclass
class TaskEntry:
    """One task name as seen in the metadata: where it points and who provides it."""

    name: str
    value: str  # "package.module:ClassName"
    distribution: str | None  # providing distribution (None for hand-built entry points)
    entry_point: md.EntryPoint
    conflicts: list[tuple[str | None, str]] = field(default_factory=list)  # other (dist, value) claims

    @property
    def claimants(self) -> str:
        claims = [(self.distribution, self.value)] + self.conflicts
        return " and ".join(f"distribution {d or '?'!r} ({v})" for d, v in claims)


def _dist_name(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def discover(entry_points: Iterable[md.EntryPoint] | None = None) -> dict[str, TaskEntry]:
    """All task entry points, by name. Nothing is imported.

    The same entry point seen twice (an editable install can expose a distribution
    twice) counts once; two *different* targets claiming one name are recorded as a
    conflict on the entry, reported when that task is loaded or listed.
    """
    if entry_points is None:
        entry_points = md.entry_points(group=GROUP)
    found: dict[str, TaskEntry] = {}
    for ep in entry_points:
        dist = _dist_name(ep)
        entry = found.get(ep.name)
        if entry is None:
            found[ep.name] = TaskEntry(ep.name, ep.value, dist, ep)
        elif ep.value != entry.value and (dist, ep.value) not in entry.conflicts:
            entry.conflicts.append((dist, ep.value))
    return dict(sorted(found.items()))


def available_tasks(entry_points: Iterable[md.EntryPoint] | None = None) -> list[str]:
    """Names of the installed tasks, sorted (metadata only)."""
    return list(discover(entry_points))


def _check_task_class(obj: object, origin: str) -> type:
    from tk.core.task import Task

    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise TypeError(f"{origin} points to {obj!r}, which is not a subclass of tk.core.task.Task")
    return obj


def _import_object(value: str, origin: str) -> object:
    module_name, _, attr = value.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def load_entry(entry: TaskEntry) -> type:
    """Import one discovered task, with errors that name the distribution."""
    origin = f"task {entry.name!r} (entry point {entry.value!r} of {entry.distribution or 'an unknown distribution'})"
    if entry.conflicts:
        raise TkError(f"task name {entry.name!r} is claimed by {entry.claimants}; "
                      f"uninstall or rename one of them")
    try:
        obj = _import_object(entry.value, origin)
    except Exception as e:  # any import-time failure of third-party code
        raise TkError(f"{origin} failed to import: {type(e).__name__}: {e}") from e
    return _check_task_class(obj, origin)


def load_task(name: str, entry_points: Iterable[md.EntryPoint] | None = None) -> type:
    """The Task class for a recipe's ``task:`` value.

    Args:
        name: an entry-point name, or ``package.module:ClassName`` for a local plugin.
        entry_points: entry points to search (default: the installed ones).

    Raises:
        TkError: unknown name (listing the available ones), conflict, or import failure.
        TypeError: the target is not a Task subclass.
    """
    if ":" in name:
        origin = f"task {name!r}"
        try:
            obj = _import_object(name, origin)
        except ModuleNotFoundError as e:
            raise TkError(f"{origin}: cannot import module {e.name!r}; is it on PYTHONPATH "
                          f"(run tk from the folder that holds it)?") from e
        except AttributeError as e:
            raise TkError(f"{origin}: {e}") from e
        except Exception as e:
            raise TkError(f"{origin} failed to import: {type(e).__name__}: {e}") from e
        return _check_task_class(obj, origin)
    entries = discover(entry_points)
    if name not in entries:
        close = difflib.get_close_matches(name, entries, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        available = ", ".join(entries) or "none installed"
        raise TkError(f"unknown task {name!r}{hint} (available: {available}; run `tk list`)")
    return load_entry(entries[name])
