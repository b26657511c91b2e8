"""The best value of the run's selection metric and early stopping on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Mapping

from tk.core.errors import TkError

__all__ = ["BestTracker", "evaluation_listener"]

# step, results -> None, or the reason to stop the run now (a sweep's pruner)
Listener = Callable[[int, Mapping[str, float]], "str | None"]
_LISTENERS: list[Listener] = []


@contextmanager
def evaluation_listener(listener: Listener) -> Iterator[None]:
    """Call ``listener(step, results)`` after every evaluation of the runs trained inside the
    block (on every process, with the results every process agrees on); a returned string
    stops the run after that evaluation (as an early stop), the string its message."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


class BestTracker:
    """Tracks ``train.best_metric`` over evaluations: the best value, the step it was
    reached at and how many evaluations ago, for early stopping.

    Args:
        key: the result key, e.g. ``"val/loss"`` (``train.best_metric``).
        mode: ``"min"`` or ``"max"`` (None: ``"min"`` for a ``*loss`` key, else ``"max"``).
        patience: evaluations without improvement before stopping (None or 0: never stop).
    """

    def __init__(self, key: str, mode: str | None = None, patience: int | None = None) -> None:
        self.key = key
        self.mode = mode or ("min" if key.endswith("loss") else "max")
        self.patience = patience
        self.value: float | None = None
        self.step: int | None = None
        self.evals_since = 0  # evaluations since the best one
        self.stopped_by: str | None = None  # an evaluation listener's reason to stop

    def update(self, results: Mapping[str, float], step: int) -> bool:
        """Fold in one evaluation's results, taken at ``step``.

        Returns:
            Whether the value improved on the best so far (the first one does).

        Raises:
            TkError: the results lack the key.
        """
        value = results.get(self.key)
        if value is None:
            raise TkError(f"train.best_metric: this evaluation returned no {self.key!r} (results: "
                          f"{', '.join(results)}); its metrics declare keys that their evaluations do not return")
        improved = self.value is None or (value > self.value if self.mode == "max" else value < self.value)
        if improved:
            self.value, self.step, self.evals_since = value, step, 0
        else:
            self.evals_since += 1
        for listener in list(_LISTENERS):
            self.stopped_by = listener(step, results) or self.stopped_by
        return improved

    @property
    def should_stop(self) -> bool:
        """Whether ``patience`` evaluations in a row brought no improvement."""
        return self.stopped_by is not None or (bool(self.patience) and self.evals_since >= self.patience)

    def stop_message(self, step: int) -> str:
        """The line that announces an early stop at ``step``."""
        if self.stopped_by is not None:
            return self.stopped_by
        return (f"early stop at step {step}: {self.key} did not improve for {self.patience} evaluations "
                f"(best {self.value:.4f} at step {self.step})")

    def state_dict(self) -> dict[str, Any]:
        """The progress keys of a checkpoint (``best_value``, ``best_step``, ``evals_since_best``)."""
        return {"best_value": self.value, "best_step": self.step, "evals_since_best": self.evals_since}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (extra keys, such as the rest of a checkpoint's progress, are ignored)."""
        self.value, self.step = state.get("best_value"), state.get("best_step")
        self.evals_since = int(state.get("evals_since_best", 0))
