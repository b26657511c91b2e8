"""The step the SIGKILL resume tests share: run a command in its own session and kill the
whole session (every process of it) once a file appears."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def kill_when(command: list[str], marker: Path, timeout: float = 300) -> None:
    """Start ``command``, wait for ``marker`` to exist, then SIGKILL its process group.

    Raises:
        AssertionError: the command ended first, or ``timeout`` seconds passed.
    """
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, f"the command ended before the test could kill it: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {marker}"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
