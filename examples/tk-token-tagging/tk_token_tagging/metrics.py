"""Entity-level F1 as a tk metric: exact-span counts summed over batches and processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tk.core import Metric, StepOutput
from tk_token_tagging.spans import prf, span_counts

IGNORE = -100  # the label of positions that are not a word's first token


class EntityF1(Metric):
    """Micro-averaged entity precision / recall / F1 over every word-tagged position.

    Reads ``out.outputs`` ((B, T, num_tags) logits) and ``batch[target_key]`` ((B, T) tag
    ids, ``-100`` where no word starts). Keys: ``entity_f1``, ``entity_precision``, ``entity_recall``.

    Args:
        tags: tag names in id order (BIO, e.g. ``["O", "B-PER", "I-PER"]``).
        target_key: the batch key of the tag ids.
    """

    def __init__(self, tags: Sequence[str], target_key: str = "tags") -> None:
        super().__init__()
        self.tags, self.target_key = list(tags), target_key
        self.add_state("counts", torch.zeros(3, dtype=torch.long))  # correct, predicted, gold entities

    def keys(self) -> list[str]:
        return ["entity_f1", "entity_precision", "entity_recall"]

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        pred = out.outputs.argmax(-1).cpu()
        gold = batch[self.target_key].cpu()
        for g_row, p_row in zip(gold, pred):
            keep = g_row != IGNORE
            g = [self.tags[i] for i in g_row[keep].tolist()]
            p = [self.tags[i] for i in p_row[keep].tolist()]
            self.counts += torch.tensor(span_counts(g, p), device=self.counts.device)

    def compute(self) -> dict[str, float]:
        precision, recall, f1 = prf(*(int(c) for c in self.counts))
        return {"entity_f1": f1, "entity_precision": precision, "entity_recall": recall}
