"""Distillation in text_classification: a teacher run with its own tokenizer scores the
student's raw texts (see :mod:`tk.core.distill` for the section and the loss)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tk.core.distill import DistillConfig, TeacherLogitsCache, check_distill, load_teacher_run
from tk.core.errors import TkError

__all__ = ["TextTeacher", "check_text_distill"]


def check_text_distill(cfg: DistillConfig, multi_label: bool) -> list[str]:
    """Problems of the ``distill:`` section for text classification."""
    problems = check_distill(cfg)
    if multi_label and cfg.type != "none":
        problems.append("distill.type: distillation matches one softmax over the classes, which a data.multi_label "
                        "run does not have; set distill.type none")
    return problems


class TextTeacher:
    """The teacher run's task (tokenizer, max_len, collate) and its logits on raw texts.

    Args:
        cfg: the ``distill:`` section (``teacher``, ``cache``).
        student: the student task (its name, ``class_names``, ``data.text_pair_column``).
        num_train: the student's training examples (sizes the cache; None: no cache).
    """

    def __init__(self, cfg: DistillConfig, student: Any, num_train: int | None) -> None:
        from tk.core.engine.inference import load_run  # lazy: the engine imports tasks

        self.task, self.model, self.record = load_teacher_run(cfg.teacher, student.name, student.class_names,
                                                              load_run)
        pairs = student.data.text_pair_column is not None
        if (self.task.data.text_pair_column is not None) != pairs:
            raise TkError(f"distill.teacher: the teacher run {cfg.teacher} classifies "
                          f"{'single texts' if pairs else 'text pairs'} but this run "
                          f"{'text pairs' if pairs else 'single texts'}; give a teacher trained on the same inputs")
        self.cache = TeacherLogitsCache(num_train) if cfg.cache and num_train else None

    def _forward(self, model: nn.Module, texts: list[str], pairs: list[str] | None, device: torch.device) -> Tensor:
        enc = self.task.encode(texts, pairs)  # the teacher's tokenizer and max_len
        batch = self.task.collate([{"input_ids": i, "token_types": t} for i, t in zip(enc.ids, enc.type_ids)])
        return model(batch["input_ids"].to(device), batch["token_types"].to(device))  # (B, C)

    @torch.no_grad()
    def logits(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        """The teacher's (B, C) logits on the batch's ``texts`` (and ``pairs``).

        Args:
            model: the frozen teacher module (the engine's ``task.teacher``, on the device).
            batch: a training batch with ``texts``, ``pairs`` (list or None) and ``index`` (B,).
        """
        texts, pairs, index = batch["texts"], batch["pairs"], batch["index"]
        device = index.device
        if self.cache is None:
            return self._forward(model, texts, pairs, device)

        def compute(rows: Tensor) -> Tensor:
            picked = rows.tolist()
            return self._forward(model, [texts[r] for r in picked],
                                 [pairs[r] for r in picked] if pairs is not None else None, device)

        return self.cache.get(index, compute)
