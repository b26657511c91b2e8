"""The `tk` CLI end to end: a plugin from a temporary distribution trains through
`tk run`; every bad input exits 2 with one line and touches nothing on disk."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import tk
from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.run.run_dir import RunDirLock

from ..conftest import make_distribution


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_version_and_help():
    assert invoke("--version").output.strip() == f"tk {tk.__version__}"
    for args in (["--help"], ["run", "--help"], ["list", "--help"], ["config", "--help"], ["validate", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0 and "Usage:" in result.output


def test_plugin_from_temporary_distribution_trains_through_cli(toy_site, toy_recipe, tmp_path):
    run_dir = tmp_path / "run"
    result = invoke("run", str(toy_recipe), f"output_dir={run_dir}")
    assert result.exit_code == 0, result.output
    assert "done: val/loss=" in result.output
    records = read_metrics(run_dir)
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert [r["step"] for r in val] == [20, 40]
    assert train[-1]["loss"] < train[0]["loss"] * 0.5  # it learns
    assert val[-1]["val/top1"] > 0.9
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["task"] == "toy" and saved["train"]["grad_accum"] == 1  # resolved, defaults included
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert (run_dir / "model.safetensors").is_file()


def test_console_script_in_subprocess(toy_site, toy_recipe, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(toy_site)}
    tk_exe = Path(sys.executable).with_name("tk")
    run_dir = tmp_path / "sub"
    proc = subprocess.run([str(tk_exe), "run", str(toy_recipe), f"output_dir={run_dir}", "train.max_steps=5",
                           "train.eval_every=5"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "metrics.jsonl").is_file()
    bad = subprocess.run([str(tk_exe), "run", str(toy_recipe), "train.batch_sise=3"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "did you mean 'batch_size'" in bad.stderr


def test_list_shows_tasks_distributions_broken_plugins_and_recipes(toy_site):
    make_distribution(toy_site, "tk-broken", "tk_broken_plugin", "raise ImportError('boom: missing dep')\n",
                      {"broken": "tk_broken_plugin:Task"})
    result = invoke("list")  # metadata only: the broken plugin is listed, not imported
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert any("toy" in line and "[tk-toy 0.1]" in line and "(run tk info toy)" in line for line in lines)
    assert any("broken" in line and "[tk-broken 0.1]" in line for line in lines)
    info = invoke("info", "broken")
    assert info.exit_code == 2 and "failed to import: ImportError: boom: missing dep" in info.stderr
    assert any("image_classification" in line for line in lines)
    assert "recipes:" in result.output and "quickstart" in result.output


def test_config_and_validate(toy_site, toy_recipe):
    result = invoke("config", str(toy_recipe), "train.seed=7")
    assert result.exit_code == 0
    resolved = yaml.safe_load(result.output)
    assert resolved["train"]["seed"] == 7 and resolved["schedule"]["name"] == "constant"
    assert invoke("validate", str(toy_recipe)).output.strip().endswith("ok (task toy)")


BAD_INPUTS = {
    "missing recipe": (["nope.yaml"], "recipe not found: 'nope.yaml'"),
    "yaml syntax": (["{bad}"], "YAML syntax error"),
    "unknown task": (["{task}"], "unknown task 'toyy'"),
    "unknown key": (["{recipe}", "optim.lrr=0.1"], "did you mean 'lr'?"),
    "unknown key in file": (["{unknown_key}"], "optim.lrr: unknown key; did you mean 'lr'?"),
    "wrong type": (["{recipe}", "train.batch_size=big"], "override 'train.batch_size=big': expected int, found 'big'"),
    "override of missing key": (["{recipe}", "data.nope=1"], "unknown key 'nope' in data"),
    "broken plugin": (["{broken}"], "failed to import: ImportError: boom"),
    "non-empty run dir": (["{recipe}"], "is not empty (a previous run?); pass --resume"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_exit_2_with_one_line_and_touch_nothing(case, toy_site, toy_recipe, tmp_path):
    make_distribution(toy_site, "tk-broken", "tk_broken_plugin", "raise ImportError('boom')\n",
                      {"broken": "tk_broken_plugin:Task"})
    run_dir = tmp_path / "existing_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("task: toy\n")
    (run_dir / "notes.txt").write_text("precious")
    files = {
        "recipe": toy_recipe,
        "bad": "task: toy\ntrain: {batch_size: [1, 2}\n",
        "task": "task: toyy\n",
        "unknown_key": "task: toy\noptim: {lrr: 0.1}\n",
        "broken": "task: broken\n",
    }
    paths = {}
    for name, text in files.items():
        if isinstance(text, Path):
            paths[name] = str(text)
        else:
            paths[name] = str(tmp_path / f"{name}.yaml")
            Path(paths[name]).write_text(text)
    args, expected = BAD_INPUTS[case]
    args = [a.format(**paths) for a in args] + [f"output_dir={run_dir}"]
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli, ["run", *args])
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_non_run_dirs_and_resume_continues(toy_site, toy_recipe, tmp_path):
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("years of work")
    result = CliRunner().invoke(cli, ["run", str(toy_recipe), f"output_dir={stranger}", "--overwrite"])
    assert result.exit_code == 2 and "refusing to delete" in result.stderr
    assert (stranger / "thesis.tex").read_text() == "years of work"

    run_dir = tmp_path / "run"
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", "train.max_steps=20").exit_code == 0
    result = invoke("run", str(toy_recipe), f"output_dir={run_dir}", "train.max_steps=40", "--resume")
    assert result.exit_code == 0, result.output
    steps = [r["step"] for r in read_metrics(run_dir) if r["split"] == "val"]
    assert steps == [20, 40]
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", "--overwrite").exit_code == 0
    assert [r["step"] for r in read_metrics(run_dir) if r["split"] == "val"] == [20, 40]
    assert not list(tmp_path.glob(".*tk-overwritten"))  # the replaced run is gone once the new one started


def test_machine_problems_are_caught_before_the_run_dir_is_made(toy_site, toy_recipe, tmp_path):
    result = CliRunner().invoke(cli, ["run", str(toy_recipe), f"output_dir={tmp_path / 'r'}",
                                      "train.device=cuda:7", "train.precision=fp16"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_failure_during_run_exits_1_with_one_line(toy_site, tmp_path):
    recipe = tmp_path / "nan.yaml"  # a learning rate so large that the loss blows up
    recipe.write_text("task: toy\noptim: {lr: 1.0e+30, name: sgd, momentum: 0.0}\n"
                      "train: {max_steps: 20, max_bad_steps: 2, progress: false}\n")
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={tmp_path / 'r'}"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: RuntimeError: 2 non-finite steps in a row")
    assert result.stderr.count("\n") == 1 and "--debug" in result.stderr


def test_missing_data_leaves_no_half_made_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "quickstart", "data.source=imagefolder",
                                      f"data.root={tmp_path / 'no_such_folder'}", f"output_dir={run_dir}"])
    assert result.exit_code == 2 and "no_such_folder" in result.stderr
    assert not run_dir.exists()  # the next `tk run` needs no --overwrite


def test_overwrite_keeps_the_old_run_when_the_new_one_fails_to_start(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".tk-run").write_text('{"tk_run": true, "run_id": "0"}\n')
    (run_dir / "config.yaml").write_text("task: image_classification\n")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli, ["run", "quickstart", "data.source=imagefolder", "--overwrite",
                                      f"data.root={tmp_path / 'no_such_folder'}", f"output_dir={run_dir}"])
    assert result.exit_code == 2 and "no_such_folder" in result.stderr
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


FAST = ["train.max_steps=4", "train.eval_every=2"]


def test_run_dirs_carry_a_marker_and_overwrite_refuses_a_foreign_config_yaml(toy_site, toy_recipe, tmp_path):
    run_dir = tmp_path / "run"
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", *FAST).exit_code == 0
    marker = json.loads((run_dir / ".tk-run").read_text())
    assert marker["tk_run"] is True and marker["tk_version"] == tk.__version__ and len(marker["run_id"]) == 32
    foreign = tmp_path / "project"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "config.yaml").write_text("db: x\n")
    (foreign / "thesis.txt").write_text("t\n")
    (foreign / "sub" / "data.csv").write_text("1,2\n")
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli, ["run", str(toy_recipe), f"output_dir={foreign}", "--overwrite", *FAST])
    assert result.exit_code == 2, result.output
    assert "was not made by `tk run` (no .tk-run marker); refusing to delete it" in result.stderr
    assert result.stderr.count("\n") == 1
    assert snapshot(tmp_path) == before and not list(tmp_path.glob(".*tk-overwritten"))


def _fail_in_step(monkeypatch, at_step: int, error: BaseException) -> None:
    from tk.core.engine.train import Trainer

    real = Trainer.train_step

    def step(self):
        if self.step + 1 >= at_step:
            raise error
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)


def _fail_in_evaluate(monkeypatch) -> None:
    from tk.core.engine.train import Trainer

    def evaluate(self, *args, **kwargs):
        raise TkError("the val split folder 'x/val' does not exist")

    monkeypatch.setattr(Trainer, "evaluate", evaluate)


def _disk_full(monkeypatch, at_save: int = 1) -> None:
    import errno

    import tk.core.run.checkpoint as ckpt

    real, calls = ckpt.torch.save, []

    def save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) >= at_save:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", save)


FAILURES_BEFORE_FIRST_CHECKPOINT = {
    # name: (overrides, monkeypatch set-up, exit code, message fragment)
    "config error": (["optim.lr=0"], None, 2, "optim.lr must be > 0"),
    "machine": (["train.device=cuda:7"], None, 2, "train.device"),
    "set-up (grad_accum > batches)": (["train.grad_accum=1000"], None, 2, "train.grad_accum"),
    "data error in step 2": ([], lambda mp: _fail_in_step(mp, 2, TkError("image 'x.png' is corrupt")), 1,
                             "image 'x.png' is corrupt (at step 1; the previous run in"),
    "non-finite loss": (["optim.lr=1e30", "optim.name=sgd", "train.max_bad_steps=1"], None, 1,
                        "non-finite"),
    "crash in step 1": ([], lambda mp: _fail_in_step(mp, 1, RuntimeError("CUDA error: device-side assert")), 1,
                        "RuntimeError: CUDA error"),
    "val split missing at the first evaluation": ([], lambda mp: _fail_in_evaluate(mp), 1,
                                                  "the val split folder 'x/val' does not exist (at step 2"),
    "Ctrl-C in step 2": ([], lambda mp: _fail_in_step(mp, 2, KeyboardInterrupt()), 130, "interrupted"),
    "disk full at the first save": ([], _disk_full, 1, "disk full (No space left on device) while writing"),
}


@pytest.mark.parametrize("case", list(FAILURES_BEFORE_FIRST_CHECKPOINT))
def test_overwrite_puts_the_old_run_back_when_the_new_one_fails_before_its_first_checkpoint(
        case, toy_site, toy_recipe, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", *FAST).exit_code == 0
    overrides, patch, code, fragment = FAILURES_BEFORE_FIRST_CHECKPOINT[case]
    before = snapshot(tmp_path)
    if patch:
        patch(monkeypatch)
    result = CliRunner().invoke(cli, ["run", str(toy_recipe), f"output_dir={run_dir}", "--overwrite", *FAST,
                                      *overrides])
    assert result.exit_code == code, result.output
    assert fragment in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert snapshot(tmp_path) == before  # byte-identical, set-aside copy gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", "site", "toy.yaml"])


def test_overwrite_drops_the_old_run_at_the_first_checkpoint(toy_site, toy_recipe, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", *FAST).exit_code == 0
    old_id = json.loads((run_dir / ".tk-run").read_text())["run_id"]
    _fail_in_step(monkeypatch, 3, TkError("image 'x.png' is corrupt"))
    result = CliRunner().invoke(cli, ["run", str(toy_recipe), f"output_dir={run_dir}", "--overwrite",
                                      "train.max_steps=4", "train.eval_every=4", "train.save_every=2"])
    assert result.exit_code == 1  # found after training started: a run failure, not a config error
    assert "image 'x.png' is corrupt (at step 2; the last checkpoint" in result.stderr
    assert "(step 2) is intact" in result.stderr and "--resume`" in result.stderr
    assert json.loads((run_dir / ".tk-run").read_text())["run_id"] != old_id
    assert (run_dir / "checkpoints" / "step_00000002.pt").is_file()
    assert not list(tmp_path.glob(".*tk-overwritten"))


def test_damaged_last_checkpoint_names_the_intact_ones_and_resume_from_continues(toy_site, toy_recipe, tmp_path):
    run_dir = tmp_path / "run"
    args = ["run", str(toy_recipe), f"output_dir={run_dir}", "train.max_steps=4", "train.eval_every=2"]
    assert invoke(*args).exit_code == 0
    last = run_dir / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:100])
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli, [*args[:3], "train.max_steps=6", "--resume"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    step4 = run_dir / "checkpoints" / "step_00000004.pt"
    assert "intact checkpoints: best.pt, step_00000004.pt, step_00000002.pt" in result.stderr
    assert f"--resume-from {step4}`" in result.stderr
    assert snapshot(tmp_path) == before
    result = CliRunner().invoke(cli, [*args[:3], "train.max_steps=6", "--resume-from", str(step4)])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run_dir) if r["split"] == "val"] == [2, 4, 6]
    from tk.core.run.checkpoint import load_checkpoint

    assert load_checkpoint(last)["step"] == 6  # last.pt written afresh


def test_a_run_dir_in_use_is_refused_and_released_however_its_run_ends(toy_site, toy_recipe, tmp_path):
    """While a run holds its run dir (flock on the marker), --resume, --resume auto and --overwrite
    there are one line naming its pid and host, and nothing moves; a SIGKILLed holder frees it."""
    run_dir = tmp_path / "run"
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", *FAST).exit_code == 0
    before = sorted(p.name for p in run_dir.rglob("*"))
    status = json.loads((run_dir / "status.json").read_text())
    held = RunDirLock()
    held.acquire(run_dir)  # another run (the lock is per open file, so this process can stand in)
    for extra in (["--resume"], ["--resume", "auto"], ["--overwrite"]):
        result = CliRunner().invoke(cli, ["run", str(toy_recipe), f"output_dir={run_dir}", "train.max_steps=8",
                                          *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert result.stderr == (f"error: {run_dir} is in use by another tk run (pid {status['pid']} on "
                                 f"{status['host']}): wait for it to end or stop it, then run this again\n")
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    held.release()
    code = ("import os, sys; from pathlib import Path; from tk.core.run.run_dir import RunDirLock; "
            "RunDirLock().acquire(Path(sys.argv[1])); os.kill(os.getpid(), 9)")
    assert subprocess.run([sys.executable, "-c", code, str(run_dir)]).returncode == -9
    assert invoke("run", str(toy_recipe), f"output_dir={run_dir}", "train.max_steps=8", "--resume").exit_code == 0


def test_a_closed_pipe_is_a_normal_end_not_an_error():
    """`tk ... | head`: the reader closes the pipe; tk ends quietly with 0, not "error: Broken pipe"."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tk", "info", "sft"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before tk writes: its first flush meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err
