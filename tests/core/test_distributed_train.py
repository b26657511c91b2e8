"""`tk run --nproc-per-node 2` (torchrun, DDP over gloo on CPU) with 8 samples x 2
micro-batches per process trains exactly like one process with batches of 32: same
weights, same per-step losses, same validation metrics (merged over both ranks); and
`torchrun --max-restarts 1 ... --resume auto` survives a worker killed after a checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tk.core.cli import cli

RECIPE = """\
task: toy_tokens
data: {num_train: 256, num_val: 64, min_len: 1, max_len: 12}
model: {hidden: 32}
optim: {lr: 0.01, weight_decay: 0.1}
schedule: {name: warmup_cosine, warmup_steps: 2}
train: {max_steps: 6, eval_every: 3, log_every: 1, progress: false, device: cpu, clip_grad_norm: 1.0}
"""


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_the_global_batch(toy_site, tmp_path):
    recipe = tmp_path / "tokens.yaml"
    recipe.write_text(RECIPE)
    single, multi = tmp_path / "single", tmp_path / "multi"
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={single}", "train.batch_size=32"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("tk")), "run", str(recipe), f"output_dir={multi}", "--nproc-per-node", "2",
         "train.batch_size=8", "train.grad_accum=2"],
        env={**os.environ, "PYTHONPATH": str(toy_site)}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(2 processes)" in proc.stdout and proc.stdout.count("done: ") == 1  # rank 0 speaks

    ours, ref = load_file(multi / "model.safetensors"), load_file(single / "model.safetensors")
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-5)
    got, want = records(multi), records(single)
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in want]  # written once
    for g, w in zip(got, want):
        for key in ("loss", "acc", "grad_norm", "val/loss", "val/top1"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-5), (g["step"], key)
    assert sorted(p.name for p in (multi / "checkpoints").glob("step_*.pt")) == ["step_00000003.pt",
                                                                                 "step_00000006.pt"]


@pytest.mark.slow
def test_torchrun_restarts_a_preempted_job_with_resume_auto(toy_site, tmp_path):
    """rank 0 dies right after step 3's checkpoint (TK_FAULT_AT_STEP, first attempt only);
    torchrun --max-restarts 1 runs the same command again, which continues from step 3."""
    recipe = tmp_path / "tokens.yaml"
    recipe.write_text(RECIPE)
    single, multi = tmp_path / "single", tmp_path / "multi"
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={single}", "train.batch_size=32"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1", "--nproc-per-node", "2",
         "-m", "tk", "run", str(recipe), f"output_dir={multi}", "train.batch_size=8", "train.grad_accum=2",
         "--resume", "auto"],
        # the restarted workers must not read the first attempt's addresses from torchrun's shared store
        # (pytorch#135712: without this, they connect to the dead workers most of the time)
        env={**os.environ, "PYTHONPATH": str(toy_site), "TK_FAULT_AT_STEP": "3",
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("TK_FAULT_AT_STEP=3: exiting abruptly") == 1, out
    assert "--resume auto: no previous run" in out and "--resume auto: continuing the run" in out, out
    assert "resumed from" in out and "at step 3" in out, out
    got, want = records(multi), records(single)
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in want]  # no step twice
    for g, w in zip(got, want):
        for key in ("loss", "val/loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-5), (g["step"], key)
