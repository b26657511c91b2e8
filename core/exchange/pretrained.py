"""A finished tk run as the pretrained source of a new run (``model.pretrained_from: RUN_DIR``).

A task that supports it calls, in a FRESH run's ``setup`` (never on resume, eval or predict,
which rebuild from the run's own task files and checkpoint):

    source = open_source(m.pretrained_from, self.name, accepts=("text_classification", "mlm"))
    if source is not None:                         # None: not a tk run (an HF folder, a hub id)
        problems = shape_conflicts(m, source.section("model"), SHAPE_KEYS)   # recipe vs source
        self.model_cfg = adopt_shape(m, source.section("model"), SHAPE_KEYS)
        source.copy_files(self.files, ["tokenizer.json"])   # the new run dir is self-contained
        write_record(self.files, source, {...})    # what resume / eval read back instead
    ...
    load_backbone(model, source.weights(), prefix="encoder.")   # in init_pretrained

The source run's weights are its checkpoint's model state dict (``best.pt``, else ``last.pt``;
its EMA weights where the run chose its model by a ``val_ema/`` metric, like ``tk eval``),
so any run whose model keeps the backbone under a known prefix is a source, whatever its
task (an ``mlm`` run's ``encoder.*`` into a classifier's ``encoder.*``).

Plugins reach this module through :mod:`tk.core.engine.inference` (the one engine module
they may import), which re-exports its public names.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from tk.core.artifacts import ARTIFACTS_DIR, TaskFiles
from tk.core.errors import TkError
from tk.core.run.checkpoint import load_checkpoint
from tk.core.run.shards import SHARDS_KEY

__all__ = ["TRANSFORMER_SHAPE_KEYS", "KEY", "RECORD_FILE", "SourceRun", "open_source", "shape_conflicts", "what_is",
           "adopt_shape", "load_backbone", "write_record", "read_record", "describe_shape"]

# the model-section keys of core's TransformerConfig that shape a backbone's tensors (or its
# computation): a run started from another takes these from the source's config
TRANSFORMER_SHAPE_KEYS = ("dim", "depth", "encoder_depth", "decoder_depth", "num_heads", "num_kv_heads", "mlp_ratio",
                          "hidden_dim", "activation", "norm", "norm_eps", "norm_first", "final_norm", "bias",
                          "norm_bias", "pos_encoding", "max_len", "tie_embeddings", "share_embeddings", "head_dim",
                          "qkv_bias", "proj_bias", "mlp_bias", "qk_norm", "norm_weight_offset", "scale_embedding",
                          "rope_theta", "rope_scaling", "attn_scale", "attn_logit_softcapping",
                          "final_logit_softcapping", "sandwich_norm", "sliding_window", "layer_types",
                          "sinusoid_layout", "pos_offset", "pad_aware_positions", "logits_bias")
KEY = "model.pretrained_from"  # the recipe key every task uses for its pretrained source
RECORD_FILE = "pretrained.json"  # task file: where the run's backbone came from and the shape it adopted


@dataclass
class SourceRun:
    """A tk run (or one of its checkpoints) that a new run starts from.

    Attributes:
        spec: the value of ``model.pretrained_from`` as given.
        checkpoint: the checkpoint file whose weights are loaded.
        task: the source run's task name.
        config: the source run's config mapping (``config.yaml``, or the checkpoint's copy).
        files_dir: the source's task-file folder (``<run>/artifacts``), None if it has none.
    """

    spec: str
    checkpoint: Path
    task: str
    config: dict[str, Any]
    files_dir: Path | None
    _state: dict[str, Any] | None = field(default=None, repr=False)

    def section(self, name: str) -> dict[str, Any]:
        """One section of the source's config (``{}`` where it has none)."""
        value = self.config.get(name)
        return dict(value) if isinstance(value, Mapping) else {}

    def weights(self) -> dict[str, torch.Tensor]:
        """The source model's state dict (its EMA weights where the run chose its model by a
        ``val_ema/`` metric), memory-mapped from the checkpoint: opening it is cheap, tensors are
        read when copied (a sharded checkpoint's are read in full from its shard folder).

        Raises:
            TkError: the checkpoint cannot be read, naming ``model.pretrained_from``.
        """
        if self._state is None:
            try:
                self._state = load_checkpoint(self.checkpoint, mmap=True)
            except TkError as e:
                raise TkError(f"{KEY}: {e}") from e
        if not isinstance(self._state.get("model"), Mapping):
            raise TkError(f"{KEY}: {self.checkpoint} holds no model weights; give a checkpoint written by `tk run`")
        best = str(self.section("train").get("best_metric") or "")
        ema = self._state.get("ema")
        if best.startswith("val_ema/") and isinstance(ema, Mapping) and "module" in ema:
            return dict(ema["module"])
        return dict(self._state["model"])

    def read_file(self, name: str) -> str:
        """The text of the source's task file ``name``.

        Raises:
            TkError: the source has no such file (a bare checkpoint away from its run dir).
        """
        path = self.files_dir / name if self.files_dir is not None else None
        if path is None or not path.is_file():
            where = self.files_dir or self.checkpoint.parent
            raise TkError(f"{KEY}: {self.spec} has no task file {name} (looked in {where}); give the source's "
                          f"run dir, which keeps it under {ARTIFACTS_DIR}/")
        return path.read_text(encoding="utf-8")

    def copy_files(self, files: TaskFiles, names: Iterable[str]) -> None:
        """Copy the source's task files ``names`` into the new run's (kept where already written),
        so the new run dir is self-contained. A no-op without a run dir (``tk summary``)."""
        for name in names:
            text = self.read_file(name)
            if files.dir is not None and not files.exists(name):
                files.write_text(name, text)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise TkError(f"{KEY}: cannot read {path}: {str(e).splitlines()[0]}") from e
    if not isinstance(loaded, dict):
        raise TkError(f"{KEY}: {path} is not a tk run config (not a mapping)")
    return loaded


def _run_checkpoint(run_dir: Path) -> Path:
    for name in ("best.pt", "last.pt"):
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    raise TkError(f"{KEY}: {run_dir} has no checkpoint (checkpoints/best.pt or last.pt); train it first, "
                  f"or give a checkpoint file")


def open_source(spec: str | None, task: str, accepts: Sequence[str]) -> SourceRun | None:
    """The tk run named by ``model.pretrained_from``, checked against the tasks this one accepts.

    A source is a run dir (holds ``config.yaml``; its ``best.pt``, else ``last.pt``, is loaded)
    or a tk checkpoint file (``.pt``; its task files are looked for in the run dir around it).

    Args:
        spec: the key's value (None: no source).
        task: the new run's task name (for the messages).
        accepts: the source tasks whose models hold a backbone this task can load.

    Returns:
        The source, or None where ``spec`` is not a tk run: a folder without ``config.yaml``
        (e.g. a Hugging Face model folder), another file, or a name (a hub id) that the task
        resolves itself.

    Raises:
        TkError: the checkpoint or config cannot be read, the run has no checkpoint, or it is
            a run of a task this one cannot start from.
    """
    if spec is None:
        return None
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.yaml").is_file():
        config = _read_yaml(path / "config.yaml")
        checkpoint, files_dir = _run_checkpoint(path), path / ARTIFACTS_DIR
    elif path.is_file() and path.suffix == ".pt":
        try:
            state = load_checkpoint(path, mmap=True, full_model=False)  # a sharded one's weights: in weights()
        except TkError as e:
            raise TkError(f"{KEY}: {e}") from e
        config = state.get("config") if isinstance(state.get("config"), dict) else {}
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        checkpoint, files_dir = path, run_dir / ARTIFACTS_DIR
        source = SourceRun(str(spec), checkpoint, str(state.get("task") or config.get("task") or "?"), config,
                           files_dir if files_dir.is_dir() else None, None if SHARDS_KEY in state else state)
        _check_task(source, task, accepts)
        return source
    else:
        return None
    source = SourceRun(str(spec), checkpoint, str(config.get("task") or "?"), config,
                       files_dir if files_dir.is_dir() else None)
    _check_task(source, task, accepts)
    return source


def what_is(spec: str) -> str:
    """``"SPEC does not exist, so it is "`` for a path that is not there, else ``"SPEC is "``: the start
    of a message that goes on ``"neither a tk run dir ..."``."""
    return f"{spec} is " if Path(spec).expanduser().exists() else f"{spec} does not exist, so it is "


def _check_task(source: SourceRun, task: str, accepts: Sequence[str]) -> None:
    if source.task not in accepts:
        raise TkError(f"{KEY}: {source.spec} is a {source.task} run; a {task} run can start from a "
                      f"{' or '.join(accepts)} run")


def shape_conflicts(section: Any, source_values: Mapping[str, Any], keys: Iterable[str],
                    prefix: str = "model", given: Collection[str] | None = None) -> list[str]:
    """The shape keys a recipe sets against the source: one line per key whose value differs
    from the source run's and that is either away from the section's default or typed as an
    override (``given``: ``"model.dim"``, ... as :attr:`RunConfig.given` holds them; so
    ``model.dim=128`` typed beside ``model.pretrained_from`` is not silently dropped when 128 is
    the default). Any other key takes the source's value (see :func:`adopt_shape`)."""
    default = type(section)()
    problems = []
    for key in keys:
        if key not in source_values or not hasattr(section, key):
            continue
        mine, theirs = getattr(section, key), source_values[key]
        written = mine != getattr(default, key) or (given is not None and f"{prefix}.{key}" in given)
        if mine != theirs and written:
            problems.append(f"{prefix}.{key}: the recipe sets {mine!r} but the {KEY} run was trained with "
                            f"{theirs!r}; the source's shape is used, so remove {prefix}.{key} or set it to {theirs!r}")
    return problems


def adopt_shape(section: Any, source_values: Mapping[str, Any], keys: Iterable[str],
                given: Collection[str] | None = None) -> Any:
    """``section`` (a dataclass) with the shape ``keys`` set to the source run's values.

    Raises:
        TkError: :func:`shape_conflicts` found a recipe value that disagrees (the first one).
    """
    problems = shape_conflicts(section, source_values, keys, given=given)
    if len(problems) == 1:
        raise TkError(problems[0])
    if problems:  # every conflict, in one line
        found = [(k, getattr(section, k), source_values[k]) for k in keys if any(p.startswith(f"model.{k}:")
                                                                                 for p in problems)]
        raise TkError(f"the recipe's model shape differs from the {KEY} run's in {len(found)} keys: "
                      + ", ".join(f"model.{k}={mine!r} (the source: {theirs!r})" for k, mine, theirs in found)
                      + "; the source's shape is used, so remove these keys or set them to the source's values")
    names = {f.name for f in dataclasses.fields(section)}
    return dataclasses.replace(section, **{k: source_values[k] for k in keys if k in source_values and k in names})


def describe_shape(cfg: Any) -> str:
    """``dim=256, depth=6, num_heads=8, ...``: the shape keys a model was built with (for the
    line a run logs about its pretrained source)."""
    keys = ("dim", "depth", "num_heads", "num_kv_heads", "hidden_dim", "activation", "norm", "norm_first",
            "pos_encoding", "patch_size")
    # the feed-forward width as built (hidden_dim, or mlp_ratio x dim): a stale ratio beside it would mislead
    values = {k: getattr(cfg, k, None) for k in keys}
    if hasattr(cfg, "ffn_dim"):
        values["hidden_dim"] = cfg.ffn_dim
    return ", ".join(f"{k}={v}" for k, v in values.items() if v is not None)


def load_backbone(model: nn.Module, weights: Mapping[str, torch.Tensor], prefix: str = "",
                  exclude: Sequence[str] = ()) -> list[str]:
    """Copy the source's tensors into ``model``'s backbone: every tensor of ``model.state_dict()``
    whose name starts with ``prefix`` and with none of ``exclude`` (the task's heads, which
    keep their fresh initialisation) is taken from ``weights`` under the same name.

    Args:
        model: the new run's freshly built model.
        weights: the source model's state dict (:meth:`SourceRun.weights`).
        prefix: where the backbone lives in both models ("encoder.", or "" for all).
        exclude: name prefixes left as built (e.g. ``("head.", "head_dist.")``).

    Returns:
        The names loaded.

    Raises:
        TkError: a backbone tensor the source lacks, or one of another shape, naming the
            first one and (for a shape) both shapes.
    """
    own = model.state_dict()
    names = [k for k in own if k.startswith(prefix) and not k.startswith(tuple(exclude))]
    for name in names:
        if name not in weights:
            raise TkError(f"{KEY}: the source model has no tensor {name!r} (its backbone tensors under "
                          f"{prefix or 'the root'!r} differ from this model's); start from a run with the same "
                          f"backbone")
        if tuple(weights[name].shape) != tuple(own[name].shape):
            raise TkError(f"{KEY}: tensor {name!r} is {tuple(weights[name].shape)} in the source but "
                          f"{tuple(own[name].shape)} in this model; give a source whose shape matches")
    model.load_state_dict({k: weights[k] for k in names}, strict=False)
    return names


def write_record(files: TaskFiles, source: SourceRun, adopted: Mapping[str, Any]) -> None:
    """Keep, as the task file ``pretrained.json``, where the backbone came from and the shape
    keys the run adopted from it (resume, eval and predict read them back with
    :func:`read_record`, so the source may be gone by then). A no-op without a run dir."""
    if files.dir is None or files.exists(RECORD_FILE):
        return
    record = {"from": source.spec, "checkpoint": str(source.checkpoint), "task": source.task, "model": dict(adopted)}
    files.write_text(RECORD_FILE, json.dumps(record, indent=1))


def read_record(files: TaskFiles) -> dict[str, Any] | None:
    """The run's ``pretrained.json`` (None where it has none)."""
    return json.loads(files.read_text(RECORD_FILE)) if files.exists(RECORD_FILE) else None
