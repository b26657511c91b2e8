"""`tk new-task`: each kind's package installs, its recipe runs through `tk run`, its own
tests pass (tk.core.testing's checks, predict, export, model.pretrained_from); the tokens kind
goes the whole way through the CLI; bad names and existing folders exit 2 with one line and
write nothing."""

import json
import subprocess
import sys
import tomllib

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tests.plugin_dist import build_wheel, install_metadata, pip_editable, subprocess_env
from tk.core.cli import cli
from tk.core.cli.scaffold import KINDS, render
from tk.core.engine.inference import load_run

FAST = ["train.max_steps=2", "train.eval_every=2", "train.batch_size=8", "train.progress=false",
        "train.device=cpu", "train.curves=false", "data.num_train=32", "data.num_val=16", "model.dim=16",
        "model.depth=1"]


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("args", [["1bad"], ["image_classification"], ["Bad"], ["class"], ["ok", "--kind", "nope"]],
                         ids=["digit", "installed-task", "uppercase", "keyword", "bad-kind"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args):
    result = CliRunner().invoke(cli, ["new-task", *args, "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert _tree(tmp_path) == []


def test_existing_folder_is_refused_and_left_alone(tmp_path):
    (tmp_path / "tk-mine").mkdir()
    (tmp_path / "tk-mine" / "keep.txt").write_text("mine")
    result = CliRunner().invoke(cli, ["new-task", "mine", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "already exists" in result.stderr and "tk-mine" in result.stderr
    assert _tree(tmp_path) == ["tk-mine", "tk-mine/keep.txt"]


def test_messages_name_the_problem(tmp_path):
    msg = CliRunner().invoke(cli, ["new-task", "1bad", "--dir", str(tmp_path)]).stderr
    assert "'1bad' is not a valid Python identifier" in msg
    msg = CliRunner().invoke(cli, ["new-task", "image_classification", "--dir", str(tmp_path)]).stderr
    assert "already taken by the installed task of tk" in msg and "ImageClassificationTask" in msg


@pytest.mark.parametrize("kind", list(KINDS))
def test_rendered_package_registers_task_and_recipe(kind):
    files = render("my_task", kind)
    meta = tomllib.loads(files["pyproject.toml"])["project"]
    assert meta["name"] == "tk-my-task"
    assert meta["entry-points"]["tk.tasks"] == {"my_task": "tk_my_task:MyTaskTask"}
    assert meta["entry-points"]["tk.recipes"] == {"my_task_demo": "tk_my_task.recipes:my_task_demo"}
    assert {"tk_my_task/recipes/my_task_demo.yaml", "tk_my_task/data.py", "tk_my_task/task.py",
            "tests/test_my_task.py"} <= files.keys()
    for path, text in files.items():
        assert "__" + "NAME__" not in text and "__CLASS" + "__" not in text, path
        if path.endswith(".py"):
            compile(text, path, "exec")
    readme = files["README.md"]
    assert "pip install -e ." in readme and "tk run my_task_demo" in readme and "pytest tests" in readme
    task = files["tk_my_task/task.py"]
    for hook in ("def setup(", "def predict(", "def example_inputs(", "pretrained_backbone = PretrainedBackbone("):
        assert hook in task, hook
    code = sum(len(text.splitlines()) for path, text in files.items() if path.startswith("tk_my_task/")
               and path.endswith(".py"))
    assert code < 300, f"the {kind} task is {code} lines: keep it readable in one sitting"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """One package per kind written by `tk new-task`, installed (metadata + source on sys.path)."""
    root = tmp_path_factory.mktemp("scaffold")
    site = root / "site"
    projects = {}
    for kind in KINDS:
        created = CliRunner().invoke(cli, ["new-task", f"sc_{kind}", "--dir", str(root), "--kind", kind])
        assert created.exit_code == 0, created.output + created.stderr
        projects[kind] = root / f"tk-sc-{kind}"
        install_metadata(projects[kind], site)
    with pytest.MonkeyPatch.context() as mp:
        for project in projects.values():
            mp.syspath_prepend(str(project))
        mp.syspath_prepend(str(site))
        yield site, projects


@pytest.mark.parametrize("kind", list(KINDS))
def test_scaffold_is_listed_and_its_recipe_runs(installed, tmp_path, kind):
    name = f"sc_{kind}"
    listing = CliRunner().invoke(cli, ["list"]).output.splitlines()
    assert f"[tk-sc-{kind} 0.1.0]" in next(line for line in listing if line.strip().startswith(name + " "))
    assert f"[tk-sc-{kind} 0.1.0]" in next(line for line in listing if line.strip().startswith(f"{name}_demo "))

    run = CliRunner().invoke(cli, ["run", f"{name}_demo", f"output_dir={tmp_path / 'run'}", *FAST])
    assert run.exit_code == 0, run.output + run.stderr
    assert "done:" in run.output and (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_tokens_scaffold_goes_the_whole_way_through_the_cli(installed, tmp_path):
    """tk run on CoNLL files, tk predict (tag names), tk export --format torch-export, a run started from
    the first (model.pretrained_from: its encoder and vocabulary), and a bad line: one error naming file:line."""
    (tmp_path / "train.txt").write_text("Alice B-PER\nvisits O\nParis B-LOC\n\nBob B-PER\nsleeps O\n")
    (tmp_path / "val.txt").write_text("Bob B-PER\nvisits O\nParis B-LOC\n")
    (tmp_path / "bad.txt").write_text("Alice B-PER\nsleeps\n")
    tiny = ["data.source=files", f"data.val_file={tmp_path / 'val.txt'}", "model.dim=16", "model.depth=1",
            "train.batch_size=2", "train.max_steps=2", "train.eval_every=2", "train.progress=false",
            "train.device=cpu", "train.curves=false"]
    train, first, second = f"data.train_file={tmp_path / 'train.txt'}", tmp_path / "first", tmp_path / "second"

    def tk(*args, code=0):
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exit_code == code, result.output
        return result

    tk("run", "sc_tokens_demo", *tiny, train, f"output_dir={first}")
    rows = [json.loads(line) for line in tk("predict", first, "Alice visits Paris", "Zed").stdout.splitlines()]
    assert [row["input"] for row in rows] == ["Alice visits Paris", "Zed"]
    assert [len(row["tags"]) for row in rows] == [3, 1]
    assert {tag for row in rows for tag in row["tags"]} <= {"B-PER", "B-LOC", "O"}  # the names in tags.json

    tk("export", first, "--format", "torch-export")
    task, model = load_run(first, "best", ["train.device=cpu"])
    inputs = task.example_inputs(model)
    program = torch.export.load(first / "export" / "torch-export" / "model.pt2").module()
    with torch.no_grad():
        torch.testing.assert_close(program(**inputs), model(**inputs))  # the graph computes the model

    tk("run", "sc_tokens_demo", *tiny, train, f"model.pretrained_from={first}", "train.max_steps=0",
       f"output_dir={second}")
    source = model.state_dict()  # the best checkpoint: what a source run gives
    started = load_file(second / "model.safetensors")  # train.max_steps=0: the starting weights
    encoder = [name for name in source if name.startswith("encoder.")]
    assert encoder and all(torch.equal(started[name], source[name]) for name in encoder)
    assert (second / "artifacts" / "vocab.json").read_text() == (first / "artifacts" / "vocab.json").read_text()

    bad = tk("run", "sc_tokens_demo", *tiny, f"data.train_file={tmp_path / 'bad.txt'}",
             f"output_dir={tmp_path / 'bad'}", code=2)
    assert bad.stderr == f"error: {tmp_path / 'bad.txt'}:2: expected 'word TAG' (two fields), got 'sleeps'\n"


@pytest.mark.slow
def test_generated_tests_pass_without_edits(installed):
    site, projects = installed
    folders = [str(p / "tests") for p in projects.values()]
    # -m "not slow" leaves out each generated file's graph exports (torch-export, onnx: the tokens kind's
    # torch-export is checked above) and its two-process run (torchrun)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *folders],
                           cwd=site.parent, env=subprocess_env(site, *projects.values()), capture_output=True,
                           text=True, check=False)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    # 7 per kind (seq2seq has 8); 2 slow ones per kind deselected
    assert f"{7 * len(projects) + 1} passed, {2 * len(projects)} deselected" in tests.stdout, tests.stdout[-3000:]


@pytest.mark.slow
def test_generated_pyproject_builds_a_wheel_with_the_recipe(tmp_path):
    assert CliRunner().invoke(cli, ["new-task", "wheely", "--dir", str(tmp_path), "--kind", "tokens"]).exit_code == 0
    wheel = build_wheel(tmp_path / "tk-wheely", tmp_path / "dist")
    names = wheel.namelist()
    assert "tk_wheely/recipes/wheely_demo.yaml" in names and "tk_wheely/task.py" in names
    entry_points = wheel.read("tk_wheely-0.1.0.dist-info/entry_points.txt").decode()
    assert "[tk.recipes]\nwheely_demo = tk_wheely.recipes:wheely_demo" in entry_points
    assert "[tk.tasks]\nwheely = tk_wheely:WheelyTask" in entry_points


@pytest.mark.slow
def test_pip_editable_install_registers_task_and_recipe(tmp_path):
    assert CliRunner().invoke(cli, ["new-task", "edit_me", "--dir", str(tmp_path)]).exit_code == 0
    site = pip_editable(tmp_path / "tk-edit-me", tmp_path / "prefix")
    # a fresh interpreter that sees the install as Python does at start-up (its .pth runs the editable finder)
    script = ("import site, sys; site.addsitedir(sys.argv[1]); from tk.core.recipe import find_recipe; "
              "print(find_recipe('edit_me_demo')); sys.argv[1:] = ['list']; from tk.core.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", script, str(site)], env=subprocess_env(), capture_output=True,
                          text=True, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == str(tmp_path / "tk-edit-me" / "tk_edit_me" / "recipes" / "edit_me_demo.yaml")
    assert "[tk-edit-me 0.1.0]" in next(line for line in lines if line.strip().startswith("edit_me "))
    assert "[tk-edit-me 0.1.0]" in next(line for line in lines if line.strip().startswith("edit_me_demo "))
