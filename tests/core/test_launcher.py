"""tk's own launcher (`tk run --nproc-per-node 2`, torch's elastic agent in the tk process,
two gloo workers): every failure is exactly one tk line on stderr, printed once, with tk's exit
code and no torchrun traceback; the resume command it suggests continues exactly."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LM = ["data.num_sentences=2000", "train.eval_every=4", "train.save_every=2", "train.progress=false",
      "model.dim=32", "model.depth=1", "data.num_samples=0", "train.log_every=1"]


def tk(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tk", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, **(env or {})})


def start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tk", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def losses(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["split"], r.get("loss"), r.get("val/loss")) for r in map(json.loads, lines)]


def one_tk_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr and "=====" not in stderr, stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def worker(run_dir_arg: str, rank: int) -> int:
    """The pid of the worker of rank ``rank`` of the job with ``run_dir_arg`` on its command line."""
    for _ in range(600):
        for pid in os.listdir("/proc"):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if run_dir_arg.encode() in cmd and f"RANK={rank}".encode() in env and b"-u" in cmd:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank}")


def wait_for(path: Path) -> None:
    for _ in range(1200):
        if path.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted two-process run the resumed ones must equal."""
    root = tmp_path_factory.mktemp("launcher")
    result = tk(root, "run", "lm_synthetic", "output_dir=straight", "train.max_steps=8", *LM, "--nproc-per-node", "2")
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
    return root / "straight"


@pytest.mark.slow
def test_a_failure_at_step_n_is_one_line_and_its_resume_command_continues_exactly(straight, tmp_path):
    result = tk(tmp_path, "run", "lm_synthetic", "output_dir=b", "train.max_steps=8", *LM, "--nproc-per-node", "2",
                env={"TK_FAULT_AT_STEP": "4"})
    assert result.returncode == 1
    line = one_tk_line(result.stderr)
    assert re.match(r"error: rank 0 \(pid \d+ on .+\) exited with code 1; the last checkpoint "
                    r"b/checkpoints/last.pt \(step 4\) is intact: continue with `tk run lm_synthetic", line), line
    command = re.search(r"`(tk run .*--resume)`", line).group(1)
    resumed = tk(tmp_path, *shlex.split(command)[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert losses(tmp_path / "b") == losses(straight)  # every logged loss, atol 0


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_worker_is_one_line_naming_rank_and_signal(tmp_path, rank):
    job = start(tmp_path, "run", "lm_synthetic", "output_dir=k", "train.max_steps=2000", *LM,
                "--nproc-per-node", "2")
    wait_for(tmp_path / "k" / "checkpoints" / "last.pt")  # step files rotate (keep_last)
    os.kill(worker("output_dir=k", rank), signal.SIGKILL)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 1
    line = one_tk_line(stderr)
    assert re.match(rf"error: rank {rank} \(pid \d+ on .+\) was killed by SIGKILL; the last checkpoint "
                    r"k/checkpoints/last.pt \(step \d+\) is intact: continue with `tk run lm_synthetic .*"
                    r"--nproc-per-node 2 --resume`$", line), line


@pytest.mark.slow
def test_an_error_on_every_rank_is_printed_once_with_exit_2(straight, tmp_path):
    """A checkpoint of another model (raised on both workers): the config error's one line, once."""
    result = tk(straight.parent, "run", "lm_synthetic", "output_dir=straight", "train.max_steps=8", *LM,
                "model.dim=48", "--resume", "--nproc-per-node", "2")
    assert result.returncode == 2
    assert "checkpoint does not fit DecoderOnlyLM" in one_tk_line(result.stderr)


@pytest.mark.slow
def test_ctrl_c_stops_the_job_with_a_checkpoint_and_exit_130(tmp_path):
    job = start(tmp_path, "run", "lm_synthetic", "output_dir=c", "train.max_steps=2000", *LM, "--nproc-per-node", "2")
    wait_for(tmp_path / "c" / "checkpoints" / "last.pt")  # step files rotate (keep_last)
    job.send_signal(signal.SIGINT)  # what the terminal's Ctrl-C sends to the launcher
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 130
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGINT after step"), stderr
