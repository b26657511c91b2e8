"""Exact resume: a run killed with SIGKILL, or stopped with SIGTERM, and resumed with
`tk run --resume` logs the same per-step losses and ends with the same weights (and EMA)
as an uninterrupted run; checkpoints of another model are refused by name. `--resume auto`
starts, continues or starts again as the run dir requires (TK_FAULT_AT_STEP stops a run)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tk.core.cli import cli
from tk.core.engine.launch import set_aside_path, write_run_marker
from tk.core.engine.train import Trainer
from tk.core.recipe import load_config
from tk.core.run.checkpoint import load_checkpoint
from tk.core.training.signals import TrainingInterrupted

from ..conftest import TOY_PLUGIN, make_distribution

# dropout and input masking (numpy) draw random numbers every step; grad_accum=2 and 12
# batches per pass make the run cross pass boundaries; evaluation at 7 and 14.
RECIPE = """\
task: toy_tokens
data: {num_train: 192, num_val: 32, mask_prob: 0.1}
model: {hidden: 32, dropout: 0.1}
optim: {lr: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 4}
train: {max_steps: 20, batch_size: 16, grad_accum: 2, eval_every: 7, log_every: 1, progress: false,
        deterministic: true, ema_decay: 0.8}
"""
TK = str(Path(sys.executable).with_name("tk"))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A toy plugin site on sys.path, the recipe, and an uninterrupted 20-step run."""
    root = tmp_path_factory.mktemp("resume")
    site = make_distribution(root / "site", "tk-toy", "tk_toy_plugin", TOY_PLUGIN,
                             {"toy": "tk_toy_plugin:ToyTask", "toy_tokens": "tk_toy_plugin:ToyTokenTask"})
    sys.path.insert(0, str(site))
    recipe = root / "tokens.yaml"
    recipe.write_text(RECIPE)
    reference = root / "reference"
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={reference}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    yield {"root": root, "site": site, "recipe": recipe, "reference": reference}
    sys.path.remove(str(site))
    torch.use_deterministic_algorithms(False)


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    assert train_losses(run_dir) == train_losses(reference)  # every step, bit for bit
    for name in ("model.safetensors", "model_ema.safetensors"):
        ours, ref = load_file(run_dir / name), load_file(reference / name)
        assert ours.keys() == ref.keys()
        for key in ref:
            assert torch.equal(ours[key], ref[key]), f"{name}: {key} differs"


def start(env, run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([TK, "run", str(env["recipe"]), f"output_dir={run_dir}", *overrides],
                            env={**os.environ, "PYTHONPATH": str(env["site"])},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before the test could signal it: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.01)


def resume(env, run_dir: Path) -> None:
    result = CliRunner().invoke(cli, ["run", str(env["recipe"]), f"output_dir={run_dir}", "--resume"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_resume_after_sigkill_is_exact(env):
    run_dir = env["root"] / "killed"
    # a checkpoint after every update; 50 ms per batch leaves time to kill mid-run
    proc = start(env, run_dir, "train.save_every=1", "data.delay=0.05")
    # step 11 written: last.pt (replaced right after each step file) holds step 10 or later
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000011.pt").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"]
    assert 10 <= killed_at < 20
    resume(env, run_dir)
    assert_same_run(run_dir, env["reference"])
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def test_sigterm_saves_a_loadable_checkpoint_and_resume_is_exact(env):
    run_dir = env["root"] / "terminated"
    stop_after = random.Random(4).randint(2, 12)
    proc = start(env, run_dir, "data.delay=0.05")
    wait_for(lambda: len(train_losses(run_dir)) >= stop_after if (run_dir / "metrics.jsonl").exists() else False,
             proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM after step" in stderr and "--resume" in stderr
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert stop_after <= state["step"] < 20
    assert f"after step {state['step']};" in stderr
    assert {"model", "optimizer", "scheduler", "ema", "rng", "data", "config"} <= set(state)
    resume(env, run_dir)
    assert_same_run(run_dir, env["reference"])


def test_sigint_stops_after_the_update_with_a_checkpoint(env):
    cfg, task_cls = load_config(env["recipe"], ["train.deterministic=false"])
    trainer = Trainer(cfg, task_cls, env["root"] / "sigint")
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in a background job (nohup, CI)
    calls = []

    def interrupt(*_):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    trainer.optimizer.register_step_post_hook(interrupt)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.signum == signal.SIGINT and info.value.step == 3
    assert load_checkpoint(info.value.checkpoint)["step"] == 3
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_resume_with_another_model_names_the_mismatch(env):
    before = {p: p.read_bytes() for p in env["reference"].rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["run", str(env["recipe"]), f"output_dir={env['reference']}",
                                      "model.hidden=64", "--resume"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: checkpoint does not fit Sequential")
    assert "shape mismatch" in result.stderr and "0.weight: checkpoint (16, 32) vs model (16, 64)" in result.stderr
    assert "model.hidden: 32 -> 64" in result.stderr
    assert {p: p.read_bytes() for p in env["reference"].rglob("*") if p.is_file()} == before


# -- tk run --resume auto (a job that torchrun --max-restarts restarts with the same command) --
def run_auto(env, run_dir: Path) -> str:
    result = CliRunner().invoke(cli, ["run", str(env["recipe"]), f"output_dir={run_dir}", "--resume", "auto"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_resume_auto_starts_a_run_in_an_absent_or_empty_dir(env):
    absent, empty = env["root"] / "auto_absent", env["root"] / "auto_empty"
    empty.mkdir()
    for run_dir in (absent, empty):
        assert "--resume auto: no previous run" in run_auto(env, run_dir)
        assert_same_run(run_dir, env["reference"])


def test_resume_auto_continues_a_run_stopped_by_a_fault_exactly(env):
    run_dir = env["root"] / "auto_fault"
    proc = subprocess.run([TK, "run", str(env["recipe"]), f"output_dir={run_dir}", "--resume", "auto"],
                          env={**os.environ, "PYTHONPATH": str(env["site"]), "TK_FAULT_AT_STEP": "7"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "TK_FAULT_AT_STEP=7: exiting abruptly" in proc.stderr, proc.stderr
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 7
    assert "--resume auto: continuing the run" in run_auto(env, run_dir)
    assert_same_run(run_dir, env["reference"])
    # the job restarted once more after it finished: nothing left to do
    assert "already reached its last step" in run_auto(env, run_dir)
    assert_same_run(run_dir, env["reference"])


def test_resume_auto_starts_again_a_run_stopped_before_its_first_checkpoint(env):
    run_dir = env["root"] / "auto_no_checkpoint"
    (run_dir / "checkpoints").mkdir(parents=True)
    write_run_marker(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 9.0}\n')
    (run_dir / "checkpoints" / ".last.pt.x.tmp").write_bytes(b"torn")  # killed during its first save
    assert "stopped before its first checkpoint; starting it again" in run_auto(env, run_dir)
    assert_same_run(run_dir, env["reference"])
    assert not set_aside_path(run_dir).exists()  # dropped once the new run saved a checkpoint


def test_resume_auto_keeps_a_run_with_weights_but_no_checkpoint(env):
    run_dir = env["root"] / "auto_weights_only"  # a finished run whose checkpoints were deleted
    run_dir.mkdir()
    write_run_marker(run_dir)
    (run_dir / "model.safetensors").write_bytes(b"weights")
    before = {p: p.read_bytes() for p in run_dir.rglob("*")}
    result = CliRunner().invoke(cli, ["run", str(env["recipe"]), f"output_dir={run_dir}", "--resume", "auto"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert {p: p.read_bytes() for p in run_dir.rglob("*")} == before
