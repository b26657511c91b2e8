"""Recipes: YAML -> typed dataclasses, dotted overrides and validation.

A recipe is one YAML mapping. ``task:`` names the task; ``data:``, ``model:`` and any
task extras are parsed into the task's dataclasses; ``optim:``, ``schedule:`` and
``train:`` into core's; ``output_dir`` is the run directory. Every error of a recipe
is collected and reported at once, each naming the file, the key path, what was
expected and what was found (with a "did you mean" for near misses).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from tk.core.errors import TkError

CORE_SECTIONS = ("optim", "schedule", "train")


@dataclass
class TrainConfig:
    """The ``train:`` section: how the engine runs the loop."""

    max_steps: int | None = None  # optimizer updates to run; overrides `epochs` when set
    epochs: int = 1  # passes over the training set (used when max_steps is unset)
    batch_size: int = 32  # samples per micro-batch on each process
    eval_batch_size: int | None = None  # samples per evaluation batch (default: batch_size)
    grad_accum: int = 1  # micro-batches accumulated into one optimizer update
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # autocast dtype; fp16 needs CUDA
    seed: int = 0  # seeds python, numpy and torch (plus the rank)
    deterministic: bool = False  # torch deterministic algorithms (slower, reproducible)
    clip_grad_norm: float | None = None  # max global gradient L2 norm; None = no clipping
    eval_every: int | None = None  # evaluate every N updates; None = after every epoch
    log_every: int = 10  # log training loss every N updates
    save_every: int | None = None  # checkpoint every N updates; None = at each evaluation
    keep_last: int = 3  # step checkpoints kept (plus best.pt and last.pt)
    best_metric: str | None = None  # e.g. "val/top1"; None = lowest val/loss
    best_mode: Literal["max", "min"] = "max"  # whether best_metric is better high or low
    num_workers: int = 0  # DataLoader worker processes
    device: str = "auto"  # "auto" (CUDA if available), "cpu", "cuda", "cuda:1", ...
    progress: bool = True  # show a progress bar
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    ema_decay: float | None = None  # EMA of the weights (e.g. 0.9999), evaluated as val_ema/*; None = off
    ema_warmup_steps: int = 0  # EMA decay warmup: decay of update n is min(ema_decay, (1+n)/(W+n)); 0 = off
    grad_checkpointing: bool = False  # recompute block activations in backward (needs model.set_grad_checkpointing)
    overfit_batches: int | None = None  # sanity mode: train on these N fixed batches only; None = off
    early_stopping_patience: int | None = None  # stop after N evaluations without a better best_metric
    compile: bool = False  # torch.compile the model for training (evaluation stays eager)


@dataclass
class RunConfig:
    """A fully resolved recipe: task name, the task's sections, core's sections."""

    task: str  # entry-point name or "package.module:ClassName"
    sections: dict[str, Any]  # the task's sections by name ("data", "model", extras)
    optim: Any  # tk.core.optim.OptimConfig
    schedule: Any  # tk.core.schedule.ScheduleConfig
    train: TrainConfig
    output_dir: str  # run directory
    source: str = ""  # recipe file the config came from
    name: str = ""  # recipe name (file stem)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a recipe mapping (loadable again with ``load_config``)."""
        out: dict[str, Any] = {"task": self.task}
        out.update({k: dataclasses.asdict(v) for k, v in self.sections.items()})
        for k in CORE_SECTIONS:
            out[k] = dataclasses.asdict(getattr(self, k))
        out["output_dir"] = self.output_dir
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


class ConfigError(TkError):
    """One or more problems with a recipe (all of them, in one message)."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        where = f"{source}: " if source else ""
        if len(problems) == 1:
            msg = where + problems[0]
        else:
            msg = f"{where}{len(problems)} problems:\n" + "\n".join("  " + p for p in problems)
        super().__init__(msg)


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
    hint = _did_you_mean(Path(recipe).stem, builtins)
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


# -- the schema -------------------------------------------------------------------
def core_schema() -> dict[str, type]:
    from tk.core.optim import OptimConfig
    from tk.core.schedule import ScheduleConfig

    return {"optim": OptimConfig, "schedule": ScheduleConfig, "train": TrainConfig}


def recipe_schema(task_cls: type) -> dict[str, Any]:
    """Top-level recipe keys -> dataclass (or plain type) for a task."""
    schema: dict[str, Any] = {"task": str, "output_dir": str | None}
    schema.update(task_cls.config_sections())
    schema.update(core_schema())
    return schema


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str, errors: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (or None after
    appending an error). Numeric strings such as ``3e-4`` (which YAML reads as text)
    are accepted for numeric fields."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of {tp.__name__} options, found {_describe(value)}")
            return None
        return build_dataclass(tp, value, path, errors)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            sub: list[str] = []
            out = _convert(arg, value, path, sub)
            if not sub:
                return out
        errors.append(f"{path}: expected {_type_name(tp)}, found {_describe(value)}")
        return None
    if origin is Literal:
        if value in args:
            return value
        errors.append(f"{path}: expected {_type_name(tp)}, found {value!r}{_did_you_mean(value, args)}")
        return None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, found {_describe(value)}")
            return None
        item_tp = args[0] if args else Any
        return [_convert(item_tp, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, found {_describe(value)}")
            return None
        val_tp = args[1] if len(args) == 2 else Any
        return {k: _convert(val_tp, v, f"{path}.{k}", errors) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _as_number(value)
        if number is not None and float(number).is_integer():
            return int(number)
    elif tp is float:
        number = _as_number(value)
        if number is not None:
            return float(number)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    errors.append(f"{path}: expected {_type_name(tp)}, found {_describe(value)}")
    return None


def _as_number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def build_dataclass(cls: type, raw: dict[str, Any], path: str, errors: list[str]) -> Any:
    """Build ``cls`` from a mapping, appending every problem to ``errors``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in fields:
            errors.append(f"{key_path}: unknown key{_did_you_mean(key, fields)} "
                          f"(valid keys: {', '.join(fields)})")
            continue
        kwargs[key] = _convert(hints[key], value, key_path, errors)
    for name, f in fields.items():
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(f"{path}.{name}: missing required key (expected {_type_name(hints[name])})")
    if errors:
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a dataclass __post_init__ check
        errors.append(f"{path}: {e}")
        return None


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
            return (f"override {text!r}: unknown key {key!r} in {where}{_did_you_mean(key, options)}"
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
    from tk.core.registry import load_task

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
        raise ConfigError(source, [f"task: expected a task name (str), found {_describe(task_name)}"])
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
            errors.append(f"{key}: unknown top-level key{_did_you_mean(key, schema)} "
                          f"(valid keys: {', '.join(schema)})")
    sections: dict[str, Any] = {}
    for name, tp in schema.items():
        if name in ("task", "output_dir"):
            continue
        value = raw.get(name)
        if value is None:
            value = {}
        sections[name] = _convert(tp, value, name, errors)
    output_dir = _convert(str | None, raw.get("output_dir"), "output_dir", errors)
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


def section_checks(cfg: RunConfig) -> list[str]:
    """Problems reported by sections' own ``check()`` methods (range checks that need
    no other section), e.g. ``OptimConfig.check``."""
    problems: list[str] = []
    for section in [*cfg.sections.values(), cfg.optim, cfg.schedule, cfg.train]:
        check = getattr(section, "check", None)
        if callable(check):
            problems.extend(check())
    return problems


def check_core_rules(cfg: RunConfig) -> list[str]:
    """Cross-field rules of core's sections."""
    t, problems = cfg.train, []
    positive = {"train.batch_size": t.batch_size, "train.grad_accum": t.grad_accum,
                "train.log_every": t.log_every, "train.keep_last": t.keep_last,
                "train.max_bad_steps": t.max_bad_steps}
    for name in ("eval_batch_size", "eval_every", "save_every", "max_steps", "overfit_batches",
                 "early_stopping_patience"):
        if getattr(t, name) is not None:
            positive[f"train.{name}"] = getattr(t, name)
    if t.max_steps is None:
        positive["train.epochs"] = t.epochs
    for key, value in positive.items():
        if value < 1:
            problems.append(f"{key}: must be >= 1, got {value}")
    if t.num_workers < 0:
        problems.append(f"train.num_workers: must be >= 0, got {t.num_workers}")
    if t.clip_grad_norm is not None and t.clip_grad_norm <= 0:
        problems.append(f"train.clip_grad_norm: must be > 0 (or null for no clipping), got {t.clip_grad_norm}")
    if t.ema_decay is not None and not 0.0 <= t.ema_decay < 1.0:
        problems.append(f"train.ema_decay: must be in [0, 1) (or null for no EMA), got {t.ema_decay}")
    if t.ema_warmup_steps < 0:
        problems.append(f"train.ema_warmup_steps: must be >= 0, got {t.ema_warmup_steps}")
    return problems
