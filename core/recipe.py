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
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tk.core.config import (
    CORE_SECTIONS,
    ConfigError,
    RunConfig,
    check_core_rules,
    convert_value,
    describe_value,
    did_you_mean,
    recipe_schema,
    section_checks,
)
from tk.core.errors import TkError
from tk.core.registry import load_task

__all__ = ["builtin_recipes", "find_recipe", "read_recipe", "parse_override", "load_config"]


# -- finding and reading recipes ----------------------------------------------------
def builtin_recipes() -> dict[str, Path]:
    """Recipes shipped with tk (package data of ``tk.recipes``), name -> path."""
    root = importlib.resources.files("tk.recipes")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def find_recipe(recipe: str) -> Path:
    """A recipe path from a file path or a built-in recipe name."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    builtins = builtin_recipes()
    if recipe in builtins:
        return builtins[recipe]
    hint = did_you_mean(Path(recipe).stem, builtins)
    raise TkError(
        f"recipe not found: {recipe!r} is neither a file nor a built-in recipe{hint}; "
        f"built-in recipes: {', '.join(sorted(builtins)) or 'none'} (run `tk list`)"
    )


def read_recipe(path: Path) -> dict[str, Any]:
    """Parse a recipe file with ``yaml.safe_load``; syntax errors carry line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TkError(f"cannot read recipe {path}: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TkError(f"{where}: YAML syntax error: {problem}") from e
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
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value  # not valid YAML: take it as a plain string
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
            options = {f.name: typing.get_type_hints(node)[f.name] for f in dataclasses.fields(node)}
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
        ConfigError: every schema and cross-field problem, at once.
    """
    task_loader = task_loader or load_task
    path = find_recipe(str(recipe))
    raw = read_recipe(path)
    parsed = [(parse_override(o), o) for o in overrides]
    for (keys, value), _ in parsed:
        if keys == ["task"]:
            raw["task"] = value
    source = str(path)
    task_name = raw.get("task")
    if task_name is None:
        raise ConfigError(source, ["task: missing; name the task to run, e.g. `task: image_classification` (see `tk list`)"])
    if not isinstance(task_name, str):
        raise ConfigError(source, [f"task: expected a task name (str), found {describe_value(task_name)}"])
    task_cls = task_loader(task_name)
    schema = recipe_schema(task_cls)

    errors: list[str] = []
    for (keys, value), text in parsed:
        problem = _check_override_path(schema, keys, text)
        if problem:
            errors.append(problem)
        else:
            _set_path(raw, keys, value)
    for key in raw:
        if key not in schema:
            errors.append(f"{key}: unknown top-level key{did_you_mean(key, schema)} "
                          f"(valid keys: {', '.join(schema)})")
    sections: dict[str, Any] = {}
    for name, tp in schema.items():
        if name in ("task", "output_dir"):
            continue
        value = raw.get(name)
        if value is None:
            value = {}
        sections[name] = convert_value(tp, value, name, errors)
    output_dir = convert_value(str | None, raw.get("output_dir"), "output_dir", errors)
    if errors:
        raise ConfigError(source, errors)

    cfg = RunConfig(
        task=task_name,
        sections={k: v for k, v in sections.items() if k not in CORE_SECTIONS},
        optim=sections["optim"], schedule=sections["schedule"], train=sections["train"],
        output_dir=output_dir or str(Path("runs") / path.stem),
        source=source, name=path.stem,
    )
    problems = check_core_rules(cfg) + section_checks(cfg) + list(task_cls.check_config(cfg))
    if problems:
        raise ConfigError(source, problems)
    return cfg, task_cls


