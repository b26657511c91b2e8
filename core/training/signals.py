"""Stopping a run cleanly: SIGINT/SIGTERM routed to a flag, and the exception that
reports where the run stopped."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["TrainingInterrupted", "StopRequest", "stop_signals"]


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run; a checkpoint of ``step`` was saved first."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}{where}; "
                         f"continue with `tk run ... --resume`")


class StopRequest:
    """The SIGINT/SIGTERM this process received (its ``__call__`` is the handler's
    callback) and the one every process agreed to stop on."""

    def __init__(self) -> None:
        self.received = 0  # the signal this process got (0: none)
        self.agreed = 0  # the signal to stop on (0: keep going)

    def __call__(self, signum: int) -> None:
        self.received = signum

    def agree(self, anyone: float) -> None:
        """After an update's all-reduce: ``anyone`` is the sum over processes of "got a
        signal"; any at all stops every process."""
        if anyone:
            self.agreed = self.received or signal.SIGTERM

    def due(self, world_size: int) -> int:
        """The signal to stop on now (0: keep going); one process needs no agreement."""
        if world_size == 1 and self.received:
            self.agreed = self.received
        return self.agreed


@contextlib.contextmanager
def stop_signals(on_signal: Callable[[int], None], rearm: bool = True) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``on_signal(signum)`` inside the block (main thread only).

    Args:
        on_signal: called from the handler; it should only set a flag.
        rearm: put the previous handler back after the first signal, so a second one
            acts at once (Ctrl-C twice). Off under torchrun, which passes the
            terminal's Ctrl-C on a second time and escalates to SIGKILL itself.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum, _frame):
        on_signal(signum)
        if rearm:
            signal.signal(signum, previous[signum] if previous[signum] is not None else signal.SIG_DFL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
