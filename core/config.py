"""The run config: core's ``train:`` section, the resolved :class:`RunConfig`, and the
typed conversion of recipe mappings into dataclasses (with every problem collected).

Reading recipe files and overrides lives in ``tk.core.recipe``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from tk.core.errors import TkError
from tk.core.optim import OptimConfig
from tk.core.schedule import ScheduleConfig

CORE_SECTIONS = ("optim", "schedule", "train")


@dataclass
class TrainConfig:
    """The ``train:`` section: how the engine runs the loop."""

    max_steps: int | None = None  # optimizer updates to run; overrides `epochs` when set; 0: evaluate and save the starting model
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
    best_mode: Literal["max", "min"] | None = None  # whether best_metric is better high or low; None: "min" for a *loss key, else "max"
    num_workers: int = 0  # DataLoader worker processes
    device: str = "auto"  # "auto" (CUDA if available), "cpu", "cuda", "cuda:1", ...
    progress: bool = True  # show a progress bar
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    ema_decay: float | None = None  # EMA of the weights (e.g. 0.9999), evaluated as val_ema/*; None = off
    ema_warmup_steps: int = 0  # EMA decay warmup: decay of update n is min(ema_decay, (1+n)/(W+n)); 0 = off
    grad_checkpointing: bool = False  # recompute each block's activations in backward (every core stack, ViT, timm models)
    overfit_batches: int | None = None  # sanity mode: train on these N fixed batches only; None = off
    early_stopping_patience: int | None = None  # stop after N evaluations without a better best_metric
    compile: bool = False  # torch.compile the model for training (evaluation stays eager)
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"  # torch.compile mode (train.compile)
    strategy: Literal["ddp", "fsdp"] = "ddp"  # several processes: ddp (whole model per process) or fsdp (sharded per block; docs/scaling.md)
    fsdp_reshard: bool = True  # fsdp: free gathered block weights after forward; false: keep them to backward
    loggers: list[Literal["jsonl", "csv", "tensorboard", "wandb"]] = field(
        default_factory=lambda: ["jsonl", "csv"])  # where scalars go: jsonl (always written), csv, tensorboard, wandb (pip install tk[NAME])
    wandb_project: str | None = None  # W&B project (loggers: [wandb]); null: "tk"
    wandb_name: str | None = None  # W&B run name; null: the run dir's name
    curves: bool = True  # write curves.png (the `tk plot` of this run) at evaluations


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
    # the "section.key" of every command-line override (None: unknown, a config built in code); not part of
    # to_dict: a shape key typed beside model.pretrained_from must match the source even at its default
    given: frozenset[str] | None = field(default=None, compare=False, repr=False)

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
    """One or more problems with a recipe, all of them in one line: ``source: problem``,
    or ``source: 3 problems: (1) ...; (2) ...; (3) ...``. A problem that starts with
    ``override '...'`` comes from the command line: when all of them do, the recipe
    file is not named."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        from_file = [p for p in problems if not p.startswith("override ")]
        where = f"{source}: " if source and from_file else ""
        if len(problems) == 1:
            msg = where + problems[0]
        else:
            listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
            msg = f"{where}{len(problems)} problems: {listed}"
        super().__init__(msg.replace("\n", " "))


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``["model.hidden: 32 -> 64", ...]`` for every leaf that differs."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, path = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, path + ".")
        elif a != b:
            out.append(f"{path}: {a!r} -> {b!r}")
    return out


# -- the schema -------------------------------------------------------------------
def core_schema() -> dict[str, type]:
    """Core's recipe sections -> their dataclasses."""
    return {"optim": OptimConfig, "schedule": ScheduleConfig, "train": TrainConfig}


def recipe_schema(task_cls: type) -> dict[str, Any]:
    """Top-level recipe keys -> dataclass (or plain type) for a task."""
    schema: dict[str, Any] = {"task": str, "output_dir": str | None}
    schema.update(task_cls.config_sections())
    schema.update(core_schema())
    return schema


# Keys of earlier versions, renamed for one vocabulary across the tasks (README): old -> new. A task
# gets each one whose new key its schema has and whose old key it does not (its own renamed_keys win).
OLD_KEYS = {"data.tokenizer": "tokenizer.kind", "data.bpe_vocab_size": "tokenizer.vocab_size",
            "data.vocab_size": "tokenizer.vocab_size", "data.tokenizer_file": "tokenizer.path",
            "data.lowercase": "tokenizer.lowercase", "data.config": "data.hf_config", "data.split": "data.hf_split",
            "data.hf_splits": "data.hf_split", "data.synthetic_seed": "data.seed", "data.dataset": "data.hf_name"}


def _has_key(schema: dict[str, Any], key: str) -> bool:
    section, _, name = key.partition(".")
    tp = schema.get(section)
    return dataclasses.is_dataclass(tp) and name in {f.name for f in dataclasses.fields(tp)}


def renamed_keys_of(task_cls: type, schema: dict[str, Any]) -> dict[str, str]:
    """The task's ``renamed_keys`` plus the shared :data:`OLD_KEYS` that apply to its schema."""
    shared = {}
    for old, new in OLD_KEYS.items():
        if _has_key(schema, old):
            continue
        if _has_key(schema, new):
            shared[old] = new
    return {**shared, **getattr(task_cls, "renamed_keys", {})}


def did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe_value(value: Any) -> str:
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


def convert_value(tp: Any, value: Any, path: str, errors: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (or None after
    appending an error). Numeric strings such as ``3e-4`` (which YAML reads as text)
    are accepted for numeric fields."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of {tp.__name__} options, found {describe_value(value)}")
            return None
        return build_dataclass(tp, value, path, errors)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for arg in options:
            sub: list[str] = []
            out = convert_value(arg, value, path, sub)
            if not sub:
                return out
        if len(options) == 1 and not sub[0].startswith(f"{path}: expected {_type_name(options[0])},"):
            errors.extend(sub)  # e.g. a non-finite float, or a nested section's own problems
        else:
            choices = [c for a in options if typing.get_origin(a) is Literal for c in typing.get_args(a)]
            hint = did_you_mean(value, choices) if choices else ""
            errors.append(f"{path}: expected {_type_name(tp)}, found {describe_value(value)}{hint}")
        return None
    if origin is Literal:
        if value in args:
            return value
        errors.append(f"{path}: expected {_type_name(tp)}, found {value!r}{did_you_mean(value, args)}")
        return None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, found {describe_value(value)}")
            return None
        item_tp = args[0] if args else Any
        return [convert_value(item_tp, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, found {describe_value(value)}")
            return None
        val_tp = args[1] if len(args) == 2 else Any
        return {k: convert_value(val_tp, v, f"{path}.{k}", errors) for k, v in value.items()}
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
        if number is not None and math.isfinite(number):
            return float(number)
        if number is not None:
            errors.append(f"{path}: expected a finite number, found {value!r}")
            return None
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    errors.append(f"{path}: expected {_type_name(tp)}, found {describe_value(value)}")
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
    """Build ``cls`` from a mapping, appending every problem to ``errors``.

    A field whose value is wrong keeps its default, so that the instance can still be
    built and range-checked (every problem of a recipe is reported at once); None
    only when a required field is missing or the constructor refuses."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    own: list[str] = []
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in fields:
            own.append(f"{key_path}: unknown key{did_you_mean(key, fields)} "
                       f"(valid keys: {', '.join(fields)})")
            continue
        bad: list[str] = []
        converted = convert_value(hints[key], value, key_path, bad)
        own.extend(bad)
        if not bad:
            kwargs[key] = converted
    missing = False
    for name, f in fields.items():
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            own.append(f"{path}.{name}: missing required key (expected {_type_name(hints[name])})")
            missing = True
    errors.extend(own)
    if missing:
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a dataclass __post_init__ check
        if not own:
            errors.append(f"{path}: {e}")
        return None


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
    for name in ("eval_batch_size", "eval_every", "save_every", "overfit_batches", "early_stopping_patience"):
        if getattr(t, name) is not None:
            positive[f"train.{name}"] = getattr(t, name)
    if t.max_steps is None:
        positive["train.epochs"] = t.epochs
    elif t.max_steps < 0:  # 0: no update; the starting model is evaluated and saved
        problems.append(f"train.max_steps: must be >= 0, got {t.max_steps}")
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
    if t.strategy == "fsdp" and t.ema_decay is not None:
        problems.append("train.ema_decay: EMA is not supported with train.strategy: fsdp (the average would "
                        "need the full weights on every process); set train.ema_decay=null or use ddp")
    if t.strategy == "fsdp" and t.precision == "fp16":  # the GradScaler's overflow check would see one shard only
        problems.append("train.precision: fp16 is not supported with train.strategy: fsdp (its loss scaling "
                        "would skip steps on some shards only); use train.precision=bf16")
    optim = getattr(cfg, "optim", None)
    if t.strategy == "fsdp" and optim is not None and optim.name == "adafactor":
        # torch's Adafactor squares a row statistic in place, which DTensor (FSDP's shards) cannot do
        problems.append("optim.name: adafactor does not run on FSDP's sharded parameters (torch's Adafactor "
                        "uses in-place ops DTensor refuses); use optim.name=adamw or lion with train.strategy: "
                        "fsdp, or train.strategy=ddp")
    repeated = sorted({n for n in t.loggers if t.loggers.count(n) > 1})
    if repeated:
        problems.append(f"train.loggers: {', '.join(repeated)} listed more than once")
    return problems
