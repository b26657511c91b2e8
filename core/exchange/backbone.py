"""``model.pretrained_from`` for any task that declares where its backbone lives: a plugin sets
``pretrained_backbone = PretrainedBackbone(prefix="encoder.", accepts=("mlm",), files=("tokenizer.json",))``
and the engine does the rest, the same way for every command:

- ``tk run`` (fresh): before the run dir is written, the source is opened (a tk run dir or ``.pt``
  checkpoint of this task or one of ``accepts``), the recipe's shape keys are checked against it
  (one line per disagreeing key); before ``setup`` the source's shape is adopted into
  ``task.model_cfg``, its task ``files`` are copied into the run's (so ``setup`` finds the
  tokenizer and loads it instead of training one) and the record ``pretrained.json`` is written;
  after ``build_model`` the source's tensors under ``prefix`` are loaded (before ``init_pretrained``).
- resume, eval, predict, average: the recorded shape is adopted before ``setup``; the weights come
  from the run's own checkpoint (the source may be gone).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from tk.core.errors import TkError
from tk.core.exchange.pretrained import (
    KEY,
    TRANSFORMER_SHAPE_KEYS,
    SourceRun,
    adopt_shape,
    load_backbone,
    open_source,
    read_record,
    shape_conflicts,
    what_is,
    write_record,
)

log = logging.getLogger(__name__)
__all__ = ["PretrainedBackbone"]


@dataclass(frozen=True)
class PretrainedBackbone:
    """A task's declaration that ``model.pretrained_from`` may seed its backbone (the class attribute
    ``Task.pretrained_backbone``; the engine calls its methods, a plugin only declares it).

    Attributes:
        prefix: where the backbone lives in the task's model and in the source's (``"encoder."``;
            ``""``: the whole model, continued training).
        accepts: other tasks whose runs hold such a backbone (the task's own runs always do).
        files: task files the source brings, copied byte for byte (its tokenizer, its vocabulary).
        shape_keys: ``model:`` keys the source decides (those the task's ``ModelConfig`` has).
    """

    prefix: str
    accepts: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    shape_keys: tuple[str, ...] = TRANSFORMER_SHAPE_KEYS

    def _open(self, task_cls: type, cfg: Any, model_cfg: Any) -> SourceRun:
        spec = model_cfg.pretrained_from
        accepts = tuple(dict.fromkeys((task_cls.name, *self.accepts)))
        # the task as the run's config.yaml names it too (a module:Class path is no registered name)
        source = open_source(spec, task_cls.name, tuple(dict.fromkeys((*accepts, cfg.task))))
        if source is None:
            raise TkError(f"{KEY}: {what_is(spec)}neither a tk run dir (a folder with config.yaml) nor a .pt checkpoint; "
                          f"a {task_cls.name} run starts from a {' or '.join(accepts)} run")
        return source

    def _keys(self, model_cfg: Any) -> list[str]:
        return [k for k in self.shape_keys if hasattr(model_cfg, k)]

    def problems(self, task_cls: type, cfg: Any) -> list[str]:
        """What ``tk run`` checks before the run dir is written (``Task.check_fresh_run``): the source
        readable and of an accepted task, its files present, its weights readable, the recipe's shape
        keys agreeing with it."""
        model_cfg = cfg.sections.get("model")
        if getattr(model_cfg, "pretrained_from", None) is None:
            return []
        try:
            source = self._open(task_cls, cfg, model_cfg)
            for name in self.files:
                source.read_file(name)
            source.weights()
        except TkError as e:
            return [str(e)]
        return shape_conflicts(model_cfg, source.section("model"), self._keys(model_cfg), given=cfg.given)

    def adopt(self, task: Any, mode: str) -> SourceRun | None:
        """Before ``setup``: a fresh run (``mode`` "train") adopts the source's shape, copies its files
        and records it, and gets the source back for :meth:`load`; a restored run adopts the recorded
        shape (its weights come from its own checkpoint).

        Raises:
            TkError: as :meth:`problems` finds (checked again: a run may be started from code).
        """
        if getattr(task.model_cfg, "pretrained_from", None) is None:
            return None
        keys = self._keys(task.model_cfg)
        if mode != "train":
            record = read_record(task.files) if task.files.dir is not None else None
            if record is not None:
                task.model_cfg = dataclasses.replace(task.model_cfg, **{k: v for k, v in record["model"].items()
                                                                        if k in keys})
            return None
        source = self._open(type(task), task.cfg, task.model_cfg)
        task.model_cfg = adopt_shape(task.model_cfg, source.section("model"), keys, task.cfg.given)
        source.copy_files(task.files, self.files)
        write_record(task.files, source, {k: getattr(task.model_cfg, k) for k in keys})
        return source

    def load(self, model: nn.Module, source: SourceRun | None) -> None:
        """After ``build_model`` of a fresh run: the source's tensors under ``prefix``."""
        if source is None:
            return
        names = load_backbone(model, source.weights(), prefix=self.prefix)
        log.info("%s: %d tensors%s from the %s run %s", KEY, len(names),
                 f" under {self.prefix!r}" if self.prefix else "", source.task, source.spec)
