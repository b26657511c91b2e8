"""Recipes: find and read a YAML recipe, apply ``key.sub=value`` overrides, validate.

A recipe is one YAML mapping. ``task:`` names the task; ``data:``, ``model:`` and any
task extras are parsed into the task's dataclasses; ``optim:``, ``schedule:`` and
``train:`` into core's; ``output_dir`` is the run directory. Every error of a recipe
is collected and reported at once, each naming the file, the key path, what was
expected and what was found (with a "did you mean" for near misses).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tk import __version__
from tk.core.config import (
    CORE_SECTIONS,
    ConfigError,
    RunConfig,
    check_core_rules,
    convert_value,
    describe_value,
    did_you_mean,
    recipe_schema,
    renamed_keys_of,
    section_checks,
)
from tk.core.errors import TkError
from tk.core.registry import PluginEntry, discover_recipes, load_task, recipe_file

__all__ = ["builtin_recipes", "plugin_recipes", "RecipeListing", "list_recipes", "find_recipe", "read_recipe",
           "parse_override", "load_config"]


# -- finding and reading recipes ----------------------------------------------------
def builtin_recipes() -> dict[str, Path]:
    """Recipes shipped with tk (package data of ``tk.recipes``), name -> path."""
    root = importlib.resources.files("tk.recipes")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def plugin_recipes() -> dict[str, PluginEntry]:
    """Recipes shipped by installed plugins (entry-point group ``tk.recipes``), name -> entry."""
    return discover_recipes()


@dataclasses.dataclass
class RecipeListing:
    """One recipe as ``tk list`` shows it."""

    name: str
    provider: str  # "tk 2.0" or the plugin's "distribution version"
    path: Path | None  # None when it cannot be located
    problem: str | None = None  # why it cannot be used (a name clash, a missing file)


def list_recipes() -> list[RecipeListing]:
    """Built-in and plugin recipes, sorted by name; clashes and missing files become ``problem``."""
    builtins = builtin_recipes()
    out = [RecipeListing(name, f"tk {__version__}", path) for name, path in builtins.items()]
    for name, entry in plugin_recipes().items():
        try:
            path, problem = _plugin_recipe_path(name, entry, builtins), None
        except TkError as e:
            path, problem = None, str(e)
        out.append(RecipeListing(name, entry.provider, path, problem))
    return sorted(out, key=lambda r: (r.name, r.provider))


def _plugin_recipe_path(name: str, entry: PluginEntry, builtins: dict[str, Path]) -> Path:
    if name in builtins:
        raise TkError(f"recipe name {name!r} is claimed by tk's built-in recipe ({builtins[name]}) and by "
                      f"distribution {entry.distribution or '?'!r} ({entry.value}); rename it in that "
                      f"distribution's [tk.recipes] entry points")
    return recipe_file(entry)


def find_recipe(recipe: str) -> Path:
    """A recipe path from a file path, a built-in recipe name or a plugin recipe name (``tk.recipes``).

    Raises:
        TkError: not found (with a did-you-mean), a folder, or a name claimed twice (naming both claimants).
    """
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise TkError(f"recipe {recipe!r} is a folder, not a YAML file; pass a file inside it "
                      f"or a recipe name (run `tk list`)")
    builtins, plugins = builtin_recipes(), plugin_recipes()
    if recipe in plugins:
        return _plugin_recipe_path(recipe, plugins[recipe], builtins)
    if recipe in builtins:
        return builtins[recipe]
    hint = did_you_mean(Path(recipe).stem, [*builtins, *plugins])
    shipped = f"; plugin recipes: {', '.join(plugins)}" if plugins else ""
    raise TkError(
        f"recipe not found: {recipe!r} is neither a file nor a built-in or plugin recipe{hint}; "
        f"built-in recipes: {', '.join(sorted(builtins)) or 'none'}{shipped} (run `tk list`)"
    )


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping of a recipe names the same key twice."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate mapping keys (plain YAML keeps the
    last one silently, so a second ``optim:`` section would replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # yaml's own construct_mapping reports it
            if key in seen:
                raise DuplicateKeyError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1}); keep one of them",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return problem if isinstance(e, DuplicateKeyError) else f"YAML syntax error: {problem}"


def read_recipe(path: Path) -> dict[str, Any]:
    """Parse a recipe file (YAML, duplicate keys refused); errors carry line and column."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TkError(f"{path}: not a UTF-8 text file (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                      f"a recipe is YAML text, saved as UTF-8") from e
    except OSError as e:
        raise TkError(f"cannot read recipe {path}: {e.strerror}") from e
    try:
        raw = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise TkError(f"{where}: {_yaml_problem(e)}") from e
    if raw is None:
        raise TkError(f"{path}: the recipe is empty; it needs at least `task: <name>` (see `tk list`)")
    if not isinstance(raw, dict):
        raise TkError(f"{path}: a recipe must be a mapping of sections, found {type(raw).__name__}")
    return raw


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> (["optim", "lr"], 3e-4); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise TkError(f"override {text!r} is not of the form key.sub=value (e.g. train.max_steps=100)")
    try:
        parsed = yaml.load(value, Loader=StrictLoader) if value.strip() else None
    except yaml.YAMLError as e:
        raise TkError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(e)}); "
                      "fix it, or put the value in YAML quotes for a plain string") from e
    return key.strip().split("."), parsed


# -- loading ----------------------------------------------------------------------
def _check_override_path(schema: dict[str, Any], keys: list[str], text: str) -> str | None:
    """None if ``keys`` names a settable option of the schema, else the problem."""
    node: Any = schema
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth]) or "the recipe"
        if isinstance(node, dict) and not dataclasses.is_dataclass(node):
            options = node
        elif dataclasses.is_dataclass(node):
            hints = typing.get_type_hints(node)  # once per section: it resolves every annotation of the class
            options = {f.name: hints[f.name] for f in dataclasses.fields(node)}
        elif typing.get_origin(node) is dict or node is dict:
            return None  # free-form mapping: any sub-key
        else:
            return f"override {text!r}: {where} is not a section, it has no key {key!r}"
        if key not in options:
            return (f"override {text!r}: unknown key {key!r} in {where}{did_you_mean(key, options)}"
                    f" (valid keys: {', '.join(options)})")
        node = _strip_optional(options[key])
    return None


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _set_path(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


def load_config(recipe: str | Path, overrides: list[str] = (), *, task_loader=None) -> tuple[RunConfig, type]:
    """Read, override and validate a recipe.

    Args:
        recipe: a recipe file path or a built-in recipe name.
        overrides: ``key.sub=value`` strings applied on top of the file.
        task_loader: name -> Task class (default ``tk.core.registry.load_task``).

    Returns:
        The resolved :class:`RunConfig` and the task class.

    Raises:
        TkError: the recipe cannot be found or read, or the task cannot be loaded.
        ConfigError: every schema and cross-field problem, at once; a problem of an
            override names the override (``override 'optim.lr=0': ...``).
    """
    path = find_recipe(str(recipe))
    raw = read_recipe(path)
    errors: list[str] = []
    parsed = []
    for text in overrides:
        try:
            parsed.append((parse_override(text), text))
        except TkError as e:
            errors.append(str(e))
    for (keys, value), _ in parsed:
        if keys == ["task"]:
            raw["task"] = value
    source = str(path)
    task_cls = _load_task(raw.get("task"), source, task_loader or load_task)
    schema = recipe_schema(task_cls)

    renamed = renamed_keys_of(task_cls, schema)
    errors += renamed_key_problems(raw, renamed)
    for (keys, value), text in parsed:
        problem = _renamed_override(keys, value, text, renamed)
        problem = problem or _check_override_path(schema, keys, text)
        if problem:
            errors.append(problem)
        else:
            _set_path(raw, keys, value)
    errors += renamed_key_problems(raw, getattr(task_cls, "renamed_keys", {}))  # old keys inside an override's section
    for key in raw:
        if key not in schema:
            errors.append(f"{key}: unknown top-level key{did_you_mean(key, schema)} "
                          f"(valid keys: {', '.join(schema)})")
    sections: dict[str, Any] = {}
    for name, tp in schema.items():
        if name in ("task", "output_dir"):
            continue
        if name in raw and raw[name] is None:
            errors.append(f"{name}: null is not a section; remove the key to keep the defaults, "
                          f"or give a mapping, e.g. `{name}: {{...}}`")
        sections[name] = convert_value(tp, {} if raw.get(name) is None else raw[name], name, errors)
    output_dir = convert_value(str | None, raw.get("output_dir"), "output_dir", errors)
    problems = _rule_problems(task_cls, raw["task"], sections, output_dir, path, complete=not errors)
    errors = _name_overrides(errors + problems, parsed)
    if errors:
        raise ConfigError(source, errors)
    given = frozenset(".".join(keys) for (keys, _), _ in parsed)
    return dataclasses.replace(_run_config(raw["task"], sections, output_dir, path), given=given), task_cls


def _lookup(raw: dict[str, Any], keys: list[str]) -> tuple[bool, Any]:
    node: Any = raw
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _renamed_message(old: str, new: str, value: Any) -> str:
    if " " in new:  # a sentence: the new key and how to write it
        return f"{old.split('=')[0]} {new}"
    if "=" in new:  # a renamed value
        key, new_value = new.split("=", 1)
        return f"{key}: {value!r} was renamed to {new_value!r}; write `{key}={new_value}`"
    section, _, field = new.partition(".")
    shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    example = f"`{section}: {{{field}: {shown}}}`"
    return f"{old.split('=')[0]} was renamed to {new}; write {example} instead"


def renamed_key_problems(raw: dict[str, Any], renamed: dict[str, str]) -> list[str]:
    """One problem per old key (or old value) of ``renamed`` found in a recipe mapping;
    each old key is removed from ``raw`` so it is not reported again as unknown."""
    problems = []
    for old, new in renamed.items():
        keys, _, old_value = old.partition("=")
        found, value = _lookup(raw, keys.split("."))
        if not found or (old_value and str(value) != old_value):
            continue
        problems.append(_renamed_message(old, new, value))
        parent = _lookup(raw, keys.split(".")[:-1])[1]
        if old_value:  # the new value, so the type check does not report it again
            parent[keys.split(".")[-1]] = new.partition("=")[2]
        else:
            del parent[keys.split(".")[-1]]
    return problems


def _renamed_override(keys: list[str], value: Any, text: str, renamed: dict[str, str]) -> str | None:
    key = ".".join(keys)
    for old, new in renamed.items():
        old_key, _, old_value = old.partition("=")
        if old_key == key and (not old_value or str(value) == old_value):
            return f"override {text!r}: {_renamed_message(old, new, value)}"
    return None


def _load_task(task_name: Any, source: str, task_loader) -> type:
    """The task class for ``task:``; every problem is a one-line TkError."""
    if task_name is None:
        raise ConfigError(source, ["task: missing; name the task to run, e.g. `task: image_classification` (see `tk list`)"])
    if not isinstance(task_name, str):
        raise ConfigError(source, [f"task: expected a task name (str), found {describe_value(task_name)}"])
    try:
        return task_loader(task_name)
    except TypeError as e:  # registry: the object named is not a Task subclass
        raise TkError(f"{e}; `task: module:Class` must name a Task class (see docs/plugins.md)") from e


def _run_config(task_name: str, sections: dict[str, Any], output_dir: str | None, path: Path) -> RunConfig:
    return RunConfig(
        task=task_name,
        sections={k: v for k, v in sections.items() if k not in CORE_SECTIONS},
        optim=sections["optim"], schedule=sections["schedule"], train=sections["train"],
        output_dir=output_dir or str(Path("runs") / path.stem),
        source=str(path), name=path.stem,
    )


def _rule_problems(task_cls: type, task_name: str, sections: dict[str, Any], output_dir: str | None,
                   path: Path, complete: bool) -> list[str]:
    """Range and cross-field problems. Also run after type errors (the wrong fields hold
    their defaults then), so that every problem is reported at once; a task's own
    check is skipped when a section could not be built at all."""
    if any(v is None for v in sections.values()):
        return []
    cfg = _run_config(task_name, sections, output_dir, path)
    problems = check_core_rules(cfg) + section_checks(cfg)
    try:
        problems += list(task_cls.check_config(cfg))
    except Exception:
        if complete:
            raise
    return problems


def _name_overrides(problems: list[str], parsed: list[tuple[tuple[list[str], Any], str]]) -> list[str]:
    """Attribute each problem to the overrides that set a key it names:
    ``optim.lr must be > 0`` -> ``override 'optim.lr=0': optim.lr must be > 0``; a problem
    about two keys that two overrides set names both."""
    last: dict[str, str] = {}
    for (keys, _), text in parsed:  # the last override of a key wins
        last[".".join(keys)] = text
    out = []
    for problem in problems:
        if not problem.startswith("override "):
            named = [text for key, text in last.items()
                     if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", problem)]
            if named:
                head = problem.split(": ", 1)
                if len(named) == 1 and len(head) == 2 and last.get(head[0]) == named[0]:
                    problem = head[1]  # "key: msg" -> "override 'key=v': msg", the key is in the override
                problem = f"override {', '.join(repr(t) for t in dict.fromkeys(named))}: {problem}"
        out.append(problem)
    return out
