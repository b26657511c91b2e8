"""The ``predict:`` section of the image task: options of ``tk predict`` (set as ``predict.top_k=3``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PredictConfig:
    """The recipe's ``predict:`` section (used by ``tk predict`` only)."""

    top_k: int = 5  # classes listed per image, most likely first (capped at the number of classes)

    def check(self) -> list[str]:
        """Range checks; one message per broken rule, naming the ``predict.*`` key."""
        return [] if self.top_k >= 1 else [f"predict.top_k must be >= 1, got {self.top_k}"]
