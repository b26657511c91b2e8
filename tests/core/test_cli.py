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
    result = invoke("list")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert any("toy" in line and "[tk-toy]" in line and "Gaussian-blob" in line for line in lines)
    assert any("broken" in line and "BROKEN" in line and "boom: missing dep" in line for line in lines)
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
    (run_dir / "config.yaml").write_text("task: image_classification\n")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli, ["run", "quickstart", "data.source=imagefolder", "--overwrite",
                                      f"data.root={tmp_path / 'no_such_folder'}", f"output_dir={run_dir}"])
    assert result.exit_code == 2
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
