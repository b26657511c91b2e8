"""tk's launcher: ``tk run RECIPE --nproc-per-node N`` runs torch's elastic agent (what
``torchrun --standalone`` runs) in this process, with N workers running ``tk run RECIPE ...``,
so that a failure is tk's one line, printed once, with tk's exit codes: a worker writes its
error line into its elastic error file instead of printing it (:data:`LAUNCHER_ENV`), and the
agent's own logging (rendezvous notes, the failure report) is silenced unless ``--debug``.
torchrun: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from tk.core.run.checkpoint import CheckpointManager

__all__ = ["LAUNCHER_ENV", "launch", "resume_advice", "report_to_launcher"]

LAUNCHER_ENV = "TK_LAUNCHED"  # set for tk's workers: an error line goes to the elastic error file
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


def report_to_launcher(line: str) -> bool:
    """In a worker of :func:`launch`: write the error ``line`` to the elastic error file (the
    launcher prints the first failing rank's, once) and return True; elsewhere False."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not os.environ.get(LAUNCHER_ENV) or not path:
        return False
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}), encoding="utf-8")
    except OSError:
        return False
    return True


def launch(nproc_per_node: int, tk_args: list[str], debug: bool = False,
           output_dir: str | None = None, command: str | None = None) -> int:
    """Run ``tk <tk_args>`` in ``nproc_per_node`` processes: torch's elastic agent (what
    torchrun runs) works in this process, so a failure is one line, printed once: the first
    failing rank, its host and its error line (the workers write it to their elastic error
    file instead of printing it, see :data:`LAUNCHER_ENV`) or the signal that killed it, and
    the command to resume when ``output_dir`` holds a checkpoint. No torchrun traceback or
    summary box (``debug`` keeps torch's own logging).

    SIGINT/SIGTERM reach the agent, which passes SIGTERM on to the workers: they save a
    checkpoint and stop.

    Returns:
        0; the failing worker's exit code (2: a config error, 1: a failure during the run);
        1 for a worker killed by a signal; 130 / 143 when Ctrl-C / SIGTERM stopped the job.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as run_agent

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc_per_node}", "-m", "tk",
                                         *tk_args])
    # torch's elastic loggers carry levels of their own (LOGLEVEL): set each one, not only the parents
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(_AGENT_LOGGERS)] + [logging.getLogger(name) for name in _AGENT_LOGGERS]
    levels = [logger.level for logger in loggers]
    previous = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = "1"  # inherited by the workers
    try:
        if not debug:  # the agent's rendezvous/OMP notes and its failure report: tk says it in one line
            for logger in loggers:
                logger.setLevel(logging.CRITICAL)
        run_agent(args)
        return 0
    except ChildFailedError as e:
        # the first failure, but not a worker the agent itself stopped with SIGTERM because another failed
        rank, failure = min(e.failures.items(), key=lambda item: (item[1].exitcode == -signal.SIGTERM,
                                                                  item[1].timestamp, item[0]))
        if failure.exitcode >= 0:  # the worker's own one line (tk's exit code: 2 config, 1 run)
            reported = failure.error_file_data.get("message")
            line = reported if isinstance(reported, str) and reported.startswith("error:") else \
                f"error: rank {rank} (pid {failure.pid} on {socket.gethostname()}) exited with code {failure.exitcode}" \
                + (resume_advice(Path(output_dir), command) if output_dir else "")
            _echo_err(line)
            return failure.exitcode
        resume = resume_advice(Path(output_dir), command) if output_dir else ""
        _echo_err(f"error: rank {rank} (pid {failure.pid} on {socket.gethostname()}) was killed by "
                       f"{failure.signal_name()}{resume}")
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if previous is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = previous


def _echo_err(line: str) -> None:
    """One line on stderr (what the CLI prints for an error)."""
    print(line, file=sys.stderr, flush=True)


def resume_advice(run_dir: Path, command: str | None) -> str:
    """``; the last checkpoint ... (step N) is intact: continue with `COMMAND --resume```, read
    from what is on disk (any process may say it), or ``""`` when no checkpoint exists."""
    manager = CheckpointManager(run_dir / "checkpoints")
    latest = manager.latest()
    if latest is None:
        return "; no checkpoint had been saved yet"
    step = manager.info.get("last", {}).get("step", "?")
    return f"; the last checkpoint {latest} (step {step}) is intact" + \
        (f": continue with `{command} --resume`" if command else "")


