"""`tk run --nproc-per-node 2` (torchrun, DDP over gloo on CPU) with 8 samples x 2
micro-batches per process trains exactly like one process with batches of 32: same
weights, same per-step losses, same validation metrics (merged over both ranks)."""

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
