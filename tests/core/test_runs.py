"""`tk runs`: a finished, an interrupted (SIGTERM; SIGKILL: a dead process) and a failed
run with the right status, steps, best metric and wall time; --json and --sort."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.engine.train import Trainer
from tk.core.run.runlog import format_duration

from ..conftest import TOY_PLUGIN, TOY_RECIPE, make_distribution


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Under one folder: a finished toy run, one stopped by SIGTERM at step 12, one whose
    first evaluation (step 20) fails."""
    base = tmp_path_factory.mktemp("runs")
    site = make_distribution(base / "site", "tk-toy", "tk_toy_plugin", TOY_PLUGIN, {"toy": "tk_toy_plugin:ToyTask"})
    recipe = base / "toy.yaml"
    recipe.write_text(TOY_RECIPE)
    sys.path.insert(0, str(site))
    root = base / "runs"
    done = invoke("run", recipe, f"output_dir={root / 'done'}")
    assert done.exit_code == 0, done.output
    original_step = Trainer.train_step

    def stop_at_12(self):
        stats = original_step(self)
        if self.step == 12:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption would
        return stats

    def broken_eval(self):
        raise RuntimeError("the evaluation broke")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "train_step", stop_at_12)
        stopped = invoke("run", recipe, f"output_dir={root / 'stopped'}")
    assert stopped.exit_code == 128 + signal.SIGTERM, stopped.output
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "_evaluate_and_track", broken_eval)
        failed = invoke("run", recipe, f"output_dir={root / 'failed'}")
    assert failed.exit_code == 1, failed.output
    yield root
    sys.path.remove(str(site))


def test_runs_lists_finished_interrupted_and_failed(runs):
    result = invoke("runs", runs)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    cells = [re.split(r"\s{2,}", line) for line in lines[:4]]  # columns: two spaces or more apart
    assert cells[0] == ["run", "task", "recipe", "status", "steps", "best", "at step", "wall time"]
    rows = {row[0]: row for row in cells[1:]}
    assert rows["done"][1:5] == ["toy", "toy", "finished", "40/40"]
    assert rows["stopped"][3:5] == ["interrupted at step 12", "12/40"]
    assert rows["failed"][3:6] == ["failed at step 20", "20/40", "-"]
    assert lines[4] == "failed: RuntimeError: the evaluation broke"
    done = json.loads(invoke("runs", runs, "--json").output)[0]
    jsonl = [json.loads(line) for line in (runs / "done" / "metrics.jsonl").read_text().splitlines()]
    best = min((r for r in jsonl if r["split"] == "val"), key=lambda r: r["val/loss"])
    assert (done["best_metric"], done["best_value"], done["best_step"]) == ("val/loss", best["val/loss"], best["step"])
    assert done["wall_time_s"] == max(r["time"] for r in jsonl) > 0
    assert rows["done"][5] == f"val/loss {best['val/loss']:.4f}" and rows["done"][6] == "40"
    assert rows["done"][7] == format_duration(done["wall_time_s"])


def test_a_killed_run_is_interrupted_at_its_last_checkpoint(runs):
    status_file = runs / "done" / "status.json"
    status = json.loads(status_file.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process
    status_file.write_text(json.dumps({**status, "status": "running", "pid": dead.pid}))
    (done,) = [r for r in json.loads(invoke("runs", runs, "--json").output) if r["run"].endswith("done")]
    assert done["status"] == "interrupted" and done["step"] == 40  # checkpoints.json: last step
    status_file.write_text(json.dumps({**status, "status": "running", "pid": os.getpid()}))
    (alive,) = [r for r in json.loads(invoke("runs", runs, "--json").output) if r["run"].endswith("done")]
    assert alive["status"] == "running"
    status_file.write_text(json.dumps(status))


def test_runs_sort_by_a_metric(runs):
    by_top1 = json.loads(invoke("runs", runs, "--json", "--sort", "val/top1").output)
    assert by_top1[0]["run"].endswith("done") and by_top1[0]["sort_step"] in (20, 40)
    assert [r["sort_value"] for r in by_top1[1:]] == [None, None]  # never evaluated: last
    values = [r["sort_value"] for r in by_top1 if r["sort_value"] is not None]
    assert values == sorted(values, reverse=True)
    by_loss = json.loads(invoke("runs", runs, "--json", "--sort", "train/loss").output)
    losses = [r["sort_value"] for r in by_loss]
    assert None not in losses and losses == sorted(losses)
    bad = invoke("runs", runs, "--sort", "val/bleu")
    assert bad.exit_code == 2 and "no run under" in bad.stderr and "val/top1" in bad.stderr
    nowhere = invoke("runs", runs / "nothing")
    assert nowhere.exit_code == 2 and "is not a directory" in nowhere.stderr
