"""The search space of ``tk sweep``: a YAML file naming recipe keys and how to sample them,
plus the objective, the sampler and the pruner.

.. code-block:: yaml

    metric: val/top1          # default: the recipe's train.best_metric (val/loss without one)
    direction: maximize       # default: minimize for a *loss metric, else maximize
    sampler: tpe              # tpe (default) | random | grid
    pruner: median            # none (default) | median | hyperband | asha (successive halving)
    seed: 0                   # the sampler's seed
    params:
      optim.lr: {low: 1.0e-4, high: 1.0e-2, log: true}        # float (low/high floats)
      train.batch_size: {low: 16, high: 64, step: 16}          # int (low/high integers)
      model.dropout: {choices: [0.0, 0.1, 0.2]}                # categorical
      train.epochs: 3                                          # fixed: every trial gets it

Every key is a recipe key (checked against the task's schema before any trial runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tk.core.errors import TkError

__all__ = ["Param", "SearchSpace", "load_space"]

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "hyperband", "asha")
_SPACE_KEYS = {"metric", "direction", "sampler", "pruner", "seed", "params"}


@dataclass(frozen=True)
class Param:
    """One recipe key: ``kind`` is float, int, categorical or fixed."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()
    value: Any = None

    def suggest(self, trial: Any) -> Any:
        """The trial's value (``trial``: an Optuna trial)."""
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=self.step or 1)
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        return self.value

    def grid(self) -> list[Any]:
        """The values a grid search tries (float ranges need a ``step``)."""
        if self.kind == "categorical":
            return list(self.choices)
        if self.kind == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.kind == "float" and self.step:
            n = int(round((self.high - self.low) / self.step))
            return [round(self.low + i * self.step, 12) for i in range(n + 1)]
        raise TkError(f"params.{self.key}: sampler grid needs a step for a float range (or choices: [...])")

    def example(self) -> Any:
        """A value in the space (for checking the key against the recipe's schema)."""
        return self.choices[0] if self.kind == "categorical" else self.value if self.kind == "fixed" else self.low


@dataclass
class SearchSpace:
    """A parsed space file."""

    params: list[Param]
    metric: str | None = None
    direction: str | None = None
    sampler: str = "tpe"
    pruner: str = "none"
    seed: int = 0
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict)
    grid_size: int | None = None  # sampler grid: the number of points

    @property
    def searched(self) -> list[Param]:
        return [p for p in self.params if p.kind != "fixed"]

    def grid(self) -> dict[str, list[Any]]:
        """Each searched key's grid values (sampler grid)."""
        return {p.key: p.grid() for p in self.searched}

    def overrides(self, values: dict[str, Any]) -> list[str]:
        """``key=value`` overrides of a trial: the fixed keys and the sampled ones."""
        out = []
        for p in self.params:
            value = p.value if p.kind == "fixed" else values[p.key]
            out.append(f"{p.key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
        return out


def _number(value: Any, where: str) -> float | int:
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string: the number it spells is meant
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TkError(f"{where}: {value!r} is not a number")
    return value


def _param(key: str, spec: Any, where: str) -> Param:
    if not isinstance(spec, dict):
        return Param(key, "fixed", value=spec)
    unknown = set(spec) - {"low", "high", "log", "step", "choices", "type"}
    if unknown:
        raise TkError(f"{where}: unknown field(s) {sorted(unknown)}; a range has low, high (log, step), a "
                      f"categorical has choices")
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise TkError(f"{where}: choices must be a non-empty list")
        return Param(key, "categorical", choices=tuple(choices))
    if "low" not in spec or "high" not in spec:
        raise TkError(f"{where}: give low and high (a range) or choices (a list)")
    low, high = _number(spec["low"], f"{where}.low"), _number(spec["high"], f"{where}.high")
    step = None if spec.get("step") is None else _number(spec["step"], f"{where}.step")
    is_int = spec.get("type") == "int" or (spec.get("type") is None and all(
        isinstance(v, int) for v in (low, high, step if step is not None else 1)))
    log = bool(spec.get("log", False))
    if not low < high:
        raise TkError(f"{where}: the range is empty (low {low} is not below high {high})")
    if log and low <= 0:
        raise TkError(f"{where}: a log range needs low > 0 (got {low})")
    if step is not None and (step <= 0 or log):
        raise TkError(f"{where}: step must be > 0 and cannot go with log: true")
    if is_int and not all(float(v).is_integer() for v in (low, high)):
        raise TkError(f"{where}: an int range needs integer low and high")
    kind = "int" if is_int else "float"
    cast = int if is_int else float
    return Param(key, kind, cast(low), cast(high), log, None if step is None else cast(step))


def load_space(path: str | Path) -> SearchSpace:
    """Parse and check a space file.

    Raises:
        TkError: a missing or unreadable file, an unknown field, an empty range, no params.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TkError(f"--space: {path} does not exist; give a YAML file with params: {{KEY: {{low, high}}}}") from None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise TkError(f"--space: {path} is not a readable YAML file ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise TkError(f"--space: {path} must be a mapping with params: {{KEY: ...}}")
    unknown = set(raw) - _SPACE_KEYS
    if unknown:
        raise TkError(f"{path}: unknown field(s) {sorted(unknown)}; a space file has {sorted(_SPACE_KEYS)}")
    params = raw.get("params")
    if not isinstance(params, dict) or not params:
        raise TkError(f"{path}: params must map recipe keys to ranges, e.g. params: {{optim.lr: {{low: 1.0e-4, "
                      f"high: 1.0e-2, log: true}}}}")
    space = SearchSpace([_param(str(k), v, f"{path}: params.{k}") for k, v in params.items()],
                        metric=raw.get("metric"), direction=raw.get("direction"),
                        sampler=str(raw.get("sampler", "tpe")), pruner=str(raw.get("pruner", "none")),
                        seed=int(raw.get("seed", 0)), source=str(path), raw=raw)
    if not space.searched:
        raise TkError(f"{path}: every param is fixed; give at least one range or choices to search")
    if space.sampler not in SAMPLERS:
        raise TkError(f"{path}: sampler {space.sampler!r} is not one of {', '.join(SAMPLERS)}")
    if space.pruner not in PRUNERS:
        raise TkError(f"{path}: pruner {space.pruner!r} is not one of {', '.join(PRUNERS)}")
    if space.direction not in (None, "minimize", "maximize"):
        raise TkError(f"{path}: direction {space.direction!r} must be minimize or maximize")
    if space.sampler == "grid":
        space.grid_size = math.prod(len(p.grid()) for p in space.searched)
    return space
