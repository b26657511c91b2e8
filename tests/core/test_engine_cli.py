"""The engine's commands: `tk summary`, `tk eval`, `tk average`, the run's CSV metrics and
progress bar, and clean refusals (fp16 on CPU, bad config before a multi-process launch,
`tk predict` for a task without prediction)."""

import csv
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tk.core.cli import cli
from tk.core.run.checkpoint import load_checkpoint


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def trained(toy_site, toy_recipe, tmp_path):
    """A 40-step toy run with step checkpoints every 10 updates."""
    run_dir = tmp_path / "run"
    result = invoke("run", toy_recipe, f"output_dir={run_dir}", "train.save_every=10", "train.keep_last=4",
                    "train.log_every=5")
    assert result.exit_code == 0, result.output
    return run_dir


def val_records(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "val"}


def test_summary_prints_every_module_output_shape_and_writes_nothing(toy_site, toy_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("summary", toy_recipe, "train.batch_size=5")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Sequential, 420 parameters (420 trainable" in out  # 8*32+32 + 32*4+4
    assert "batch: {x: (5, 8), labels: (5,)}" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["0", "Linear", "288", "(5,", "32)"] in lines
    assert ["1", "ReLU", "0", "(5,", "32)"] in lines
    assert ["2", "Linear", "132", "(5,", "4)"] in lines
    assert "activation memory:" in out
    assert not (tmp_path / "runs").exists()


def test_eval_rebuilds_the_run_and_reproduces_its_metrics(trained):
    result = invoke("eval", trained, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    best = load_checkpoint(trained / "checkpoints" / "best.pt")["step"]
    assert report["step"] == best and report["split"] == "val"
    for key, value in val_records(trained)[best].items():
        if key.startswith("val/"):
            assert report["metrics"][key] == pytest.approx(value, abs=1e-6)
    text = invoke("eval", trained, "--checkpoint", "last", "--split", "val", "train.eval_batch_size=7")
    assert text.exit_code == 0 and "step 40" in text.output and "val/top1" in text.output
    no_ema = invoke("eval", trained, "--ema")
    assert no_ema.exit_code == 2 and "holds no EMA weights" in no_ema.stderr


def test_average_of_the_last_checkpoints(trained, tmp_path):
    out = tmp_path / "avg.safetensors"
    result = invoke("average", trained, "--last", "3", "-o", out)
    assert result.exit_code == 0, result.output
    assert "averaged steps 20, 30, 40" in result.output
    states = [load_checkpoint(trained / "checkpoints" / f"step_{s:08d}.pt")["model"] for s in (20, 30, 40)]
    averaged = load_file(out)
    for key in states[0]:
        torch.testing.assert_close(averaged[key], sum(s[key] for s in states) / 3)
    too_many = invoke("average", trained, "--last", "9", "-o", tmp_path / "avg9.safetensors")
    assert too_many.exit_code == 2 and "holds 4 step checkpoint(s) (10, 20, 30, 40)" in too_many.stderr


def test_metrics_csv_matches_jsonl(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    with open(trained / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) == 8 + 2  # train every 5 steps, val at 20 and 40
    for row, record in zip(rows, records):
        assert {k: v for k, v in row.items() if v != ""} == {k: str(v) for k, v in record.items()}


def test_progress_bar_shows_loss_lr_throughput(toy_site, toy_recipe, tmp_path):
    result = invoke("run", toy_recipe, f"output_dir={tmp_path / 'r'}", "train.progress=true", "train.max_steps=5",
                    "train.log_every=1", "train.eval_every=5")
    assert result.exit_code == 0, result.output
    assert "train: 100%" in result.stderr and "5/5" in result.stderr
    assert "loss=" in result.stderr and "lr=" in result.stderr and "items/s" in result.stderr


def test_fp16_on_cpu_is_a_clean_error(toy_site, toy_recipe, tmp_path):
    result = invoke("run", toy_recipe, f"output_dir={tmp_path / 'r'}", "train.precision=fp16", "train.device=cpu")
    assert result.exit_code == 2
    assert result.stderr == "error: train.precision: fp16 needs a CUDA device (got 'cpu'); use bf16 on CPU\n"
    assert not (tmp_path / "r").exists()


def test_multi_process_launch_checks_config_and_run_dir_first(toy_site, toy_recipe, tmp_path):
    bad = invoke("run", toy_recipe, "--nproc-per-node", "2", "train.batch_sise=3")
    assert bad.exit_code == 2 and "did you mean 'batch_size'" in bad.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep")
    busy = invoke("run", toy_recipe, "--nproc-per-node", "2", f"output_dir={tmp_path / 'busy'}")
    assert busy.exit_code == 2 and "is not empty" in busy.stderr


def test_predict_on_a_task_without_predict_is_a_clean_error(trained):
    result = invoke("predict", trained, "some input", "train.device=cpu")
    assert result.exit_code == 2
    assert result.stderr == ("error: task 'toy' does not support prediction (its Task class has no predict "
                             "method); use `tk eval` for metrics\n")
