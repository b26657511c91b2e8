"""The Task contract: the one extension point of tk.

A task supplies what differs between jobs (data, model, loss, metrics, prediction);
the engine (``tk.core.engine`` and the layers under it: ``training``, ``run``, ``exchange``)
owns everything else (devices, precision, gradient accumulation, clipping, schedules,
checkpoints, logging, distribution).

Every command builds a task in one order (``tk.core.training.assemble``):
construct ``Task(cfg, run_dir)`` -> ``load_state_dict`` (resume, eval, predict, average)
-> ``setup(resume=...)`` -> data -> ``build_model`` -> ``init_pretrained`` (fresh
training runs only) -> LoRA (``lora_names``; ``init_adapters`` on fresh training runs). See ``docs/plugins.md`` for which hook runs in which command.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tk.core.artifacts import TaskFiles
from tk.core.config import RunConfig
from tk.core.data.loader import LoaderSpec, build_loader
from tk.core.metrics import Metric
from tk.core.optim import OptimConfig, param_groups
from tk.core.step import EvalContext, StepOutput


@dataclass
class EmptyConfig:
    """Placeholder section for tasks that have no options there."""


class Task:
    """Base class for a task plugin. Subclass it directly (one level only).

    Class attributes:
        name: the entry-point name (``tk.tasks`` group); also the plugin folder name.
        DataConfig: dataclass for the recipe's ``data:`` section.
        ModelConfig: dataclass for the recipe's ``model:`` section.
        extra_sections: further top-level recipe sections owned by the task
            (e.g. ``{"mixup": MixupConfig, "distill": DistillConfig}``).
        renamed_keys: old recipe key -> its new name (``"data.bpe_vocab_size":
            "tokenizer.vocab_size"``; a value rename as ``"data.source=hub": "data.source=hf"``;
            a text with a space is the hint itself: ``"was renamed to data.hf_split (a mapping)"``);
            a recipe or override using an old key is a config error naming the new one.
        metric_names: the keys the task's metrics log (without ``val/``), for a task whose
            ``build_metrics`` needs ``setup()``: ``tk run``/``validate``/``sweep`` check
            ``train.best_metric`` against them before anything starts (else after set-up, with a note).

    An instance is built from a validated :class:`tk.core.config.RunConfig` and the
    run directory it belongs to (None where a command has none, e.g. ``tk summary``);
    ``self.data``, ``self.model_cfg`` and ``self.sections[name]`` hold the task's
    parsed sections, ``self.cfg`` the whole run config, ``self.run_dir`` the run dir
    where it is now (never ``cfg.output_dir``, which may have moved) and ``self.files``
    its task files (``<run_dir>/artifacts``).
    """

    name: ClassVar[str] = ""
    DataConfig: ClassVar[type] = EmptyConfig
    ModelConfig: ClassVar[type] = EmptyConfig
    extra_sections: ClassVar[Mapping[str, type]] = {}
    renamed_keys: ClassVar[Mapping[str, str]] = {}
    predict_rows: ClassVar[bool] = False  # predict() also takes dict rows (the lines of a .jsonl input)
    # model.pretrained_from for this task: a tk.core.exchange.PretrainedBackbone (where the backbone lives,
    # which runs seed it, the files they bring); the engine does the rest. None: the task handles the key itself
    pretrained_backbone: ClassVar[Any] = None
    metric_names: ClassVar[tuple[str, ...]] = ()  # what build_metrics' metrics log ("top1"), where it needs setup()

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.files = TaskFiles(self.run_dir)
        self.data = cfg.sections["data"]
        self.model_cfg = cfg.sections["model"]
        self.sections = cfg.sections
        self.teacher: nn.Module | None = None  # set by the engine from build_teacher()

    # -- schema ------------------------------------------------------------------
    @classmethod
    def config_sections(cls) -> dict[str, type]:
        """All recipe sections this task owns, name -> dataclass."""
        return {"data": cls.DataConfig, "model": cls.ModelConfig, **cls.extra_sections}

    @classmethod
    def check_config(cls, cfg: RunConfig) -> list[str]:
        """Cross-field rules, checked before anything heavy starts.

        Returns one message per broken rule, each naming the key path(s), e.g.
        ``"train.batch_size: Mixup needs an even batch size, got 7"``.
        """
        return []

    @classmethod
    def check_fresh_run(cls, cfg: RunConfig) -> list[str]:
        """Checks only a fresh training run needs, run by ``tk run`` before its run dir is
        written (``check_config`` also runs for resume, eval and predict, which must work
        without these inputs): e.g. that ``model.pretrained_from`` names a readable run of a
        task this one can start from, whose shape the recipe agrees with.

        Returns one message per problem, each naming the key. Default: the checks of a declared
        ``pretrained_backbone`` (see :mod:`tk.core.exchange.backbone`).
        """
        return cls.pretrained_backbone.problems(cls, cfg) if cls.pretrained_backbone is not None else []

    # -- lifecycle ---------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Prepare shared state before data and model are built (e.g. train a tokenizer
        and write it with ``self.files.write_text``).

        Args:
            resume: True where a saved run is rebuilt (resume, eval, predict, average):
                ``load_state_dict`` has run already and the task files written by the
                first set-up exist; load them instead of recomputing (a tokenizer must
                never be retrained there). False on a fresh training run and in
                ``tk summary`` (which has no run dir: ``self.run_dir`` is None).
        """

    def report(self, message: str) -> None:
        """One line in ``train.log`` and on the console (rank 0), as the built-in tasks say what they
        loaded, dropped or truncated; heard during set-up, model building and evaluation (as is
        ``logging.getLogger(__name__).info`` anywhere in the plugin's package)."""
        logging.getLogger(f"tk.task.{self.name or type(self).__name__}").info(message)

    def state_dict(self) -> dict[str, Any]:
        """Task state that a checkpoint must carry to reload the task (tokenizer, vocab).
        Values must be plain Python (str, int, float, lists, dicts)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    # -- data --------------------------------------------------------------------
    def build_dataset(self, split: str) -> Dataset:
        """The dataset of one split (``"train"``, ``"val"``, ``"test"``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_dataset")

    def collate(self, samples: list[Any]) -> dict[str, Any]:
        """Turn a list of dataset items into a batch dict (``torch`` default collation)."""
        return torch.utils.data.default_collate(samples)

    def build_loader(self, split: str, spec: LoaderSpec) -> DataLoader:
        """A loader for ``split``. Override for custom batching (e.g. by token count),
        but honour ``spec`` (batch size, shuffling, seed, rank/world size)."""
        return build_loader(self.build_dataset(split), spec, collate_fn=self.collate)

    def transform_batch(self, batch: dict[str, Any], training: bool) -> dict[str, Any]:
        """Per-batch transform run on the device before ``loss`` (e.g. Mixup)."""
        return batch

    # -- model and loss ----------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The model: a core backbone plus the task's head."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model")

    def init_pretrained(self, model: nn.Module) -> None:
        """Load pretrained weights into a freshly built model (e.g. a timm backbone).

        Called on a fresh training run only, after ``build_model`` and before the
        optimiser is built; resume, eval and predict load the run's own weights instead,
        so a pretrained file is not needed to evaluate a finished run.
        """

    def lora_names(self, model: nn.Module) -> Mapping[str, tuple[str, int, int]]:
        """Other names ``model.lora.targets`` may use for the model's Linear layers: those of the
        model's source family (a Llama's ``q_proj``), each as (tk Linear, its first row, rows),
        also inside a fused tk layer. Default: none."""
        return {}

    def init_adapters(self, model: nn.Module) -> None:
        """Fill a fresh training run's LoRA adapters once ``apply_lora`` has added them (e.g. from a
        PEFT adapter folder, ``model.adapter_from``). Default: as LoRA initialises them."""

    def param_groups(self, model: nn.Module, optim_cfg: OptimConfig) -> list[dict[str, Any]]:
        """The optimiser's parameter groups (default: core's decay / no-decay groups with
        ``optim.layer_decay``). Override e.g. for a lower learning rate on a pretrained
        backbone than on a new head: ``param_groups(model, optim_cfg, lr_scale=...)``."""
        return param_groups(model, optim_cfg)

    def build_teacher(self) -> nn.Module | None:
        """An optional frozen model (distillation). The engine moves it to the device,
        puts it in eval mode without gradients and stores it in ``self.teacher``."""
        return None

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Forward pass and summed loss for one training batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss")

    def eval_step(self, model: nn.Module, batch: dict[str, Any], ctx: EvalContext) -> StepOutput:
        """Forward pass for evaluation; ``outputs`` feeds the metrics. Override to add
        e.g. beam-search hypotheses for BLEU, where ``ctx`` says to (``ctx.every(n)``)."""
        return self.loss(model, batch)

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        """Fresh metrics for one evaluation pass (``ctx.split`` names the split); each
        gets ``update(step_output, batch)`` per batch, is synced across processes, then
        ``compute()``-d. Each metric declares its result keys (``Metric.keys()``), which
        must not collide, so ``train.best_metric`` is checked before training."""
        return {}

    # -- inference ---------------------------------------------------------------
    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """Optional: one JSON-ready dict per raw input (file path, sentence, prompt), in order.

        ``tk predict`` calls it on batches of ``--batch-size`` inputs, the model in eval mode
        on its device, under ``torch.no_grad`` and the run's autocast. Options (top-k, beam
        size) are config keys of the task's sections, read from ``self.sections`` and set on
        the command line as ``section.key=value``. An unusable input gets
        ``{"error": "<input>: <problem>"}``; raising ``TkError``/``OSError``/``ValueError``
        instead makes the engine retry the batch one input at a time.
        """
        raise NotImplementedError(f"task {self.name!r} does not support prediction")

    def example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Optional: keyword arguments of ``model.forward`` for ``tk export --format
        torch-export|onnx`` (a batch of 2, on the CPU). Dim 0 of each tensor is exported as a
        dynamic batch; a 2-D integer tensor (token ids) also gets a dynamic dim 1. None (the
        default): the model cannot be exported as a graph."""
        return None

    @classmethod
    def describe(cls) -> str:
        """One line for ``tk list``: the first line of the class docstring."""
        doc = (cls.__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""

