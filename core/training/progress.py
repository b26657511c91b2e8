"""The run's progress counters (items seen, skipped and non-finite updates, evaluations,
training wall time) and when the next evaluation is due; all counters go into checkpoints."""

from __future__ import annotations

import time
from typing import Any, Mapping

__all__ = ["RunProgress", "eval_due"]


class RunProgress:
    """Counters of a run that a checkpoint keeps so that a resumed run continues them.

    Attributes:
        items_seen: items (tokens, samples) of all updates so far.
        skipped_steps: updates not applied (non-finite, or an fp16 overflow).
        bad_steps: non-finite updates in a row (an applied update resets it).
        evaluations: periodic/final evaluations done.
    """

    def __init__(self) -> None:
        self.items_seen = 0.0
        self.skipped_steps = 0
        self.bad_steps = 0
        self.evaluations = 0
        self._wall_time = 0.0  # training seconds of the sessions before this one
        self._clock: tuple[float, float] | None = None  # (monotonic time, wall time) when the clock started

    def count_update(self, items: float, skipped: str | None) -> None:
        """Count one update of ``items`` items; ``skipped``: None (applied), ``"overflow"``
        or ``"non-finite"`` (only this one counts as a bad step)."""
        self.items_seen += items
        if skipped is None:
            self.bad_steps = 0
        else:
            self.skipped_steps += 1
            self.bad_steps += skipped == "non-finite"

    def start_clock(self) -> None:
        """Start counting training time (``fit``), on top of the resumed sessions'."""
        self._clock = (time.monotonic(), self._wall_time)

    def wall_time(self) -> float:
        """Training wall-clock seconds of the run, resumed sessions added up."""
        if self._clock is None:
            return self._wall_time
        return round(self._clock[1] + time.monotonic() - self._clock[0], 3)

    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps, "evaluations": self.evaluations,
                "items_seen": self.items_seen, "wall_time": self.wall_time()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (keys it lacks keep their values; others are ignored)."""
        self.bad_steps = int(state.get("bad_steps", self.bad_steps))
        self.skipped_steps = int(state.get("skipped_steps", self.skipped_steps))
        self.evaluations = int(state.get("evaluations", self.evaluations))
        self.items_seen = float(state.get("items_seen", self.items_seen))
        self._wall_time = float(state.get("wall_time", self._wall_time))


def eval_due(step: int, total_steps: int, eval_every: int | None, steps_per_epoch: int | None) -> bool:
    """Whether to evaluate after update ``step``: at the end, every ``eval_every`` updates,
    or (``eval_every`` None) after each epoch (no epochs: at the end only)."""
    if step == total_steps:
        return True
    if eval_every is not None:
        return step % eval_every == 0
    return steps_per_epoch is not None and step % steps_per_epoch == 0
