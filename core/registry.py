"""Plugin discovery through entry points: tasks (``tk.tasks``), CLI commands (``tk.commands``)
and recipes (``tk.recipes``).

Built-in tasks register in ``setup.py`` exactly as third-party ones do in theirs
(as flake8 does with its own checkers). Discovery reads only package metadata
(names, targets, the providing distribution's name, version and summary);
``load_task`` / ``load_command`` import exactly one plugin. A recipe may also name
an uninstalled local plugin as ``task: package.module:ClassName``.

A recipe entry point ``NAME = package.sub:stem`` names the YAML file ``stem.yaml`` in the
folder ``sub`` of the installed package ``package`` (package data); it is located
without importing the package.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import click

from tk.core.errors import TkError

GROUP = "tk.tasks"
COMMANDS_GROUP = "tk.commands"
RECIPES_GROUP = "tk.recipes"


@dataclass
class PluginEntry:
    """One entry-point name as seen in the metadata: where it points and who provides it."""

    name: str
    value: str  # "package.module:object"
    distribution: str | None  # providing distribution (None for hand-built entry points)
    entry_point: md.EntryPoint
    conflicts: list[tuple[str | None, str]] = field(default_factory=list)  # other (dist, value) claims
    version: str | None = None  # the distribution's version
    summary: str | None = None  # the distribution's one-line ``Summary`` metadata

    @property
    def claimants(self) -> str:
        claims = [(self.distribution, self.value)] + self.conflicts
        return " and ".join(f"distribution {d or '?'!r} ({v})" for d, v in claims)

    @property
    def provider(self) -> str:
        """``"tk-toy 0.1"``: the distribution and its version, for listings."""
        if self.distribution is None:
            return "?"
        return f"{self.distribution} {self.version}" if self.version else self.distribution


TaskEntry = PluginEntry  # the name this class had when only tasks were discovered


def _dist_metadata(ep: md.EntryPoint) -> tuple[str | None, str | None, str | None]:
    """(name, version, summary) of the distribution providing ``ep``; reads metadata only."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None, None
    meta = dist.metadata
    summary = (meta.get("Summary") or "").strip()
    return meta["Name"], dist.version, summary if summary and summary != "UNKNOWN" else None


def discover(entry_points: Iterable[md.EntryPoint] | None = None, group: str = GROUP) -> dict[str, PluginEntry]:
    """All entry points of ``group``, by name, sorted. Nothing is imported.

    The same entry point seen twice (an editable install can expose a distribution
    twice) counts once; two *different* targets claiming one name are recorded as a
    conflict on the entry, reported when that plugin is loaded or listed.
    """
    if entry_points is None:
        entry_points = md.entry_points(group=group)
    found: dict[str, PluginEntry] = {}
    for ep in entry_points:
        dist, version, summary = _dist_metadata(ep)
        entry = found.get(ep.name)
        if entry is None:
            found[ep.name] = PluginEntry(ep.name, ep.value, dist, ep, version=version, summary=summary)
        elif ep.value != entry.value and (dist, ep.value) not in entry.conflicts:
            entry.conflicts.append((dist, ep.value))
    return dict(sorted(found.items()))


def available_tasks(entry_points: Iterable[md.EntryPoint] | None = None) -> list[str]:
    """Names of the installed tasks, sorted (metadata only)."""
    return list(discover(entry_points))


def discover_commands(entry_points: Iterable[md.EntryPoint] | None = None) -> dict[str, PluginEntry]:
    """The plugin commands of the ``tk.commands`` group, by name (metadata only)."""
    return discover(entry_points, COMMANDS_GROUP)


def discover_recipes(entry_points: Iterable[md.EntryPoint] | None = None) -> dict[str, PluginEntry]:
    """The recipes plugins ship (``tk.recipes`` group), by name (metadata only)."""
    return discover(entry_points, RECIPES_GROUP)


def recipe_file(entry: PluginEntry) -> Path:
    """The YAML file of a ``tk.recipes`` entry ``package.sub:stem`` -> ``<package>/sub/stem.yaml``.

    Only the top-level package is looked up (``importlib.util.find_spec``), never imported.

    Raises:
        TkError: a name claimed twice, a malformed value, the package is not installed,
            or the file is missing; each names the distribution.
    """
    origin = f"recipe {entry.name!r} (entry point {entry.value!r} of {entry.distribution or 'an unknown distribution'})"
    if entry.conflicts:
        raise TkError(f"recipe name {entry.name!r} is claimed by {entry.claimants}; uninstall or rename one of them")
    module, sep, stem = entry.value.partition(":")
    parts = module.strip().split(".")
    if not sep or not stem.strip() or not all(p.isidentifier() for p in parts):
        raise TkError(f"{origin}: the value must be `package.folder:stem` (the file package/folder/stem.yaml)")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise TkError(f"{origin}: package {parts[0]!r} is not installed as a package folder; reinstall the distribution")
    for location in locations:
        path = Path(location).joinpath(*parts[1:], stem.strip() + ".yaml")
        if path.is_file():
            return path
    raise TkError(f"{origin}: {Path(locations[0]).joinpath(*parts[1:], stem.strip() + '.yaml')} does not exist; "
                  f"ship it as package data of {parts[0]!r}")


def _check_task_class(obj: object, origin: str) -> type:
    from tk.core.task import Task  # lazy: tk.core.task imports torch, which `tk list` must not need

    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise TypeError(f"{origin} points to {obj!r}, which is not a subclass of tk.core.task.Task")
    return obj


def _import_object(value: str) -> object:
    module_name, _, attr = value.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def _import_entry(entry: PluginEntry, kind: str) -> tuple[object, str]:
    """Import one entry's target; conflicts and import failures become TkError."""
    origin = (f"{kind} {entry.name!r} (entry point {entry.value!r} of "
              f"{entry.distribution or 'an unknown distribution'})")
    if entry.conflicts:
        raise TkError(f"{kind} name {entry.name!r} is claimed by {entry.claimants}; "
                      f"uninstall or rename one of them")
    try:
        return _import_object(entry.value), origin
    except Exception as e:  # any import-time failure of third-party code
        raise TkError(f"{origin} failed to import: {type(e).__name__}: {e}") from e


def load_entry(entry: PluginEntry) -> type:
    """Import one discovered task, with errors that name the distribution."""
    obj, origin = _import_entry(entry, "task")
    return _check_task_class(obj, origin)


def load_command(entry: PluginEntry, builtin: Iterable[str] = ()) -> click.Command:
    """Import one discovered plugin command.

    Args:
        entry: a ``tk.commands`` entry (``name = package.module:command_object``).
        builtin: names of tk's own commands, which a plugin may not take.

    Raises:
        TkError: the name clashes with a built-in command or another plugin, the import
            fails, or the object is not a click command; each names the distribution.
    """
    if entry.name in set(builtin):
        raise TkError(f"command {entry.name!r} of distribution {entry.distribution or '?'!r} ({entry.value}) "
                      f"clashes with the built-in `tk {entry.name}`; rename it in that distribution's "
                      f"[{COMMANDS_GROUP}] entry points or uninstall it")
    obj, origin = _import_entry(entry, "command")
    if not isinstance(obj, click.Command):
        raise TkError(f"{origin} points to {obj!r}, which is not a click command "
                      f"(decorate it with @click.command())")
    return obj


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
            obj = _import_object(name)
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
