"""The one assembly order of every command, task files, moved run dirs, `tk average` into a
tk checkpoint, optimiser groups from the task, and the checks that must fail before training."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.optim import OptimConfig

from .distributions import write_distribution

RECORDING_PLUGIN = textwrap.dedent('''
    """A task that records every lifecycle hook into a file (tk's lifecycle tests)."""
    import json
    import os
    from dataclasses import dataclass

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from tk.core.optim import param_groups
    from tk.core.metrics import Accuracy
    from tk.core.step import StepOutput
    from tk.core.task import Task


    def record(event):
        with open(os.environ["TK_RECORD"], "a") as f:
            f.write(event + "\\n")


    @dataclass
    class Data:
        num: int = 64  # samples per split
        seed: int = 0  # data seed


    @dataclass
    class Model:
        hidden: int = 16  # hidden width
        head_lr_scale: float = 1.0  # lr multiplier of the head (layer "1") vs the backbone


    class RecordingTask(Task):
        """Records its hooks (test plugin)."""

        name = "recording"
        DataConfig = Data
        ModelConfig = Model

        def __init__(self, cfg, run_dir=None):
            super().__init__(cfg, run_dir)
            self.vocab = None
            record(f"init run_dir={'set' if run_dir is not None else 'none'}")

        def load_state_dict(self, state):
            record(f"load_state_dict vocab={state.get('vocab')}")
            self.vocab = state.get("vocab")

        def state_dict(self):
            return {"vocab": self.vocab}

        def setup(self, resume=False):
            record(f"setup resume={resume}")
            if self.run_dir is None:
                self.vocab = 4
            elif resume:  # load, never recompute
                self.vocab = json.loads(self.files.read_text("vocab.json"))["size"]
            else:
                self.vocab = 4
                self.files.write_text("vocab.json", json.dumps({"size": self.vocab}))

        def build_dataset(self, split):
            record(f"build_dataset {split}")
            g = torch.Generator().manual_seed(self.data.seed + (split == "train"))
            x = torch.randn(self.data.num, 8, generator=g)
            return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())

        def collate(self, samples):
            x, y = torch.utils.data.default_collate(samples)
            return {"x": x, "labels": y}

        def build_model(self):
            record(f"build_model vocab={self.vocab}")
            return nn.Sequential(nn.Linear(8, self.model_cfg.hidden), nn.ReLU(), nn.Linear(self.model_cfg.hidden, self.vocab))

        def init_pretrained(self, model):
            record("init_pretrained")

        def param_groups(self, model, optim_cfg):
            scale = self.model_cfg.head_lr_scale
            return param_groups(model, optim_cfg, lr_scale=lambda name: scale if name.startswith("2.") else 1.0)

        def loss(self, model, batch):
            logits = model(batch["x"])
            loss = nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="sum")
            return StepOutput(loss=loss, num_items=batch["labels"].numel(), outputs=logits)

        def build_metrics(self, ctx):
            return {"acc": Accuracy()}

        def predict(self, model, inputs):
            record("predict")
            x = torch.tensor([[float(v) for v in text.split(",")] for text in inputs])
            return [{"label": int(i)} for i in model(x).argmax(-1)]
''')

RECIPE = textwrap.dedent('''
    task: recording
    optim: {lr: 0.01}
    train: {max_steps: 6, batch_size: 16, eval_every: 3, save_every: 2, keep_last: 5, progress: false}
''')

ORDER = {  # the documented order of each command (tk.core.training.assemble)
    "train": ["init run_dir=set", "setup resume=False", "build_dataset train", "build_dataset val",
              "build_model vocab=4", "init_pretrained"],
    "resume": ["init run_dir=set", "load_state_dict vocab=4", "setup resume=True", "build_dataset train",
               "build_dataset val", "build_model vocab=4"],
    "eval": ["init run_dir=set", "load_state_dict vocab=4", "setup resume=True", "build_dataset val",
             "build_model vocab=4"],
    "predict": ["init run_dir=set", "load_state_dict vocab=4", "setup resume=True", "build_model vocab=4",
                "predict"],
    "summary": ["init run_dir=none", "setup resume=False", "build_dataset train", "build_model vocab=4"],
    "average": ["init run_dir=set", "load_state_dict vocab=4", "setup resume=True", "build_model vocab=4"],
}


@pytest.fixture
def env(tmp_path, monkeypatch):
    site = write_distribution(tmp_path / "site", "tk-recording", "tk_recording_plugin", RECORDING_PLUGIN,
                              {"tk.tasks": {"recording": "tk_recording_plugin:RecordingTask"}})
    monkeypatch.syspath_prepend(str(site))
    record = tmp_path / "record.txt"
    monkeypatch.setenv("TK_RECORD", str(record))
    recipe = tmp_path / "recording.yaml"
    recipe.write_text(RECIPE)

    def run(*args):
        record.write_text("")
        result = CliRunner().invoke(cli, [str(a) for a in args])
        return result, record.read_text().splitlines()

    return {"root": tmp_path, "recipe": recipe, "run": run}


def test_every_command_builds_the_task_in_the_documented_order(env):
    run, run_dir = env["run"], env["root"] / "run"
    result, events = run("run", env["recipe"], f"output_dir={run_dir}", "train.max_steps=4")
    assert result.exit_code == 0, result.output
    assert events == ORDER["train"]
    task_file = run_dir / "artifacts" / "vocab.json"
    written = (task_file.read_bytes(), task_file.stat().st_mtime_ns)

    result, events = run("run", env["recipe"], f"output_dir={run_dir}", "--resume")
    assert result.exit_code == 0, result.output
    assert events == ORDER["resume"]
    result, events = run("eval", run_dir)
    assert result.exit_code == 0, result.output
    assert events == ORDER["eval"]
    result, events = run("predict", run_dir, "1,0,0,0,0,0,0,0")
    assert result.exit_code == 0, result.output
    assert events == ORDER["predict"]
    result, events = run("summary", env["recipe"])
    assert result.exit_code == 0, result.output
    assert events == ORDER["summary"]
    result, events = run("average", run_dir, "--last", "3", "-o", env["root"] / "avg.pt")
    assert result.exit_code == 0, result.output
    assert events == ORDER["average"]
    # the task file written at the first set-up was read, never rewritten (checkpoints at 2, 3 (eval), 4, 6)
    assert (task_file.read_bytes(), task_file.stat().st_mtime_ns) == written


def test_a_moved_run_dir_evaluates_and_predicts_from_another_working_directory(env, tmp_path, monkeypatch):
    run, run_dir = env["run"], env["root"] / "run"
    assert run("run", env["recipe"], f"output_dir={run_dir}")[0].exit_code == 0
    before = json.loads(run("eval", run_dir, "--json")[0].output)
    moved = tmp_path / "elsewhere" / "moved_run"
    moved.parent.mkdir()
    shutil.move(str(run_dir), str(moved))
    other = tmp_path / "cwd"
    other.mkdir()
    monkeypatch.chdir(other)
    result, _ = run("eval", moved, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["metrics"] == before["metrics"]
    result, _ = run("predict", moved, "1,0,0,0,0,0,0,0", "0,-1,0,0,0,0,0,0")
    assert result.exit_code == 0, result.output
    assert [sorted(json.loads(line)) for line in result.output.splitlines()] == [["input", "label"]] * 2
    assert not (other / "runs").exists() and not any(other.iterdir())  # nothing written in the cwd


def test_average_writes_a_tk_checkpoint_that_eval_and_predict_accept(env, monkeypatch):
    run, root = env["run"], env["root"]
    run_dir = root / "run"
    assert run("run", env["recipe"], f"output_dir={run_dir}")[0].exit_code == 0
    monkeypatch.chdir(root)
    result, _ = run("average", run_dir, "--last", "3", "-o", "avg.pt")
    assert result.exit_code == 0, result.output
    assert "averaged steps 3, 4, 6 -> avg.pt" in result.output
    avg = torch.load(root / "avg.pt", weights_only=True)
    assert avg["averaged_steps"] == [3, 4, 6] and avg["task_state"] == {"vocab": 4} and avg["step"] == 6
    steps = [torch.load(run_dir / "checkpoints" / f"step_0000000{s}.pt", weights_only=True)["model"] for s in (3, 4, 6)]
    assert torch.allclose(avg["model"]["0.weight"], sum(s["0.weight"] for s in steps) / 3)
    result, _ = run("eval", run_dir, "--checkpoint", "avg.pt", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["checkpoint"] == "avg.pt" and {"val/loss", "val/top1"} <= set(report["metrics"])
    assert run("predict", run_dir, "--checkpoint", "avg.pt", "1,0,0,0,0,0,0,0")[0].exit_code == 0
    # bare weights: --weights with the run's config
    result, _ = run("average", run_dir, "--last", "2", "-o", "avg.safetensors")
    assert result.exit_code == 0, result.output
    assert (root / "artifacts" / "vocab.json").is_file()  # task files copied next to the exported weights
    result, _ = run("eval", run_dir, "--weights", "avg.safetensors", "--json")
    assert result.exit_code == 0, result.output


def test_task_param_groups_give_the_head_its_own_learning_rate(env):
    from tk.core.engine.train import Trainer
    from tk.core.recipe import load_config

    cfg, task_cls = load_config(str(env["recipe"]), ["model.head_lr_scale=10.0", "optim.lr=0.001"])
    trainer = Trainer(cfg, task_cls, None)
    lrs = {name: group["lr"] for group in trainer.optimizer.param_groups for name in group["param_names"]}
    assert lrs["0.weight"] == pytest.approx(0.001) and lrs["0.bias"] == pytest.approx(0.001)
    assert lrs["2.weight"] == pytest.approx(0.01) and lrs["2.bias"] == pytest.approx(0.01)
    trainer.train_step()
    assert trainer.scheduler.get_last_lr()[-1] == pytest.approx(0.01)  # the schedule keeps the ratio


def test_a_best_metric_typo_fails_before_the_first_step_with_a_suggestion(env):
    run, run_dir = env["run"], env["root"] / "run"
    result, events = run("run", env["recipe"], f"output_dir={run_dir}", "train.best_metric=val/top")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: train.best_metric: 'val/top' is not an evaluation result; did you "
                                     "mean 'val/top1'? (results: val/loss, val/top1)")
    # refused by the pre-run checks tk validate shares (issue #35): the metrics' declared keys of a task
    # made without a run dir, before any set-up or data, and before the run dir is written
    assert events == ["init run_dir=none"]
    assert not run_dir.exists()


def test_a_broken_val_split_fails_before_the_first_step(env, monkeypatch):
    import tk_recording_plugin

    real = tk_recording_plugin.RecordingTask.build_dataset

    def no_val(self, split):
        if split == "val":
            raise FileNotFoundError("no folder data/val")
        return real(self, split)

    monkeypatch.setattr(tk_recording_plugin.RecordingTask, "build_dataset", no_val)
    run, run_dir = env["run"], env["root"] / "run"
    result, events = run("run", env["recipe"], f"output_dir={run_dir}")
    assert result.exit_code == 1 and "no folder data/val" in result.stderr
    assert events[-1] == "build_dataset train" and "init_pretrained" not in events
    assert not (run_dir / "checkpoints").exists()


def test_param_groups_default_matches_core(env):
    from tk.core.optim import param_groups
    from tk.core.recipe import load_config
    from tk.core.task import Task

    cfg, _ = load_config(str(env["recipe"]))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    ours = Task(cfg).param_groups(model, OptimConfig())
    assert [g["param_names"] for g in ours] == [g["param_names"] for g in param_groups(model, OptimConfig())]


def test_best_metric_must_be_returned_by_every_evaluation(env):
    """A metric added only on some evaluations (``ctx.every(n)``) cannot be the best metric."""
    from tk.core.errors import TkError
    from tk.core.metrics import Accuracy, Mean
    from tk.core.recipe import load_config
    from tk.core.task import Task
    from tk.core.training.build import check_best_metric

    class Costly(Task):
        def build_metrics(self, ctx):
            metrics = {"acc": Accuracy()}
            if ctx.every(4):  # e.g. beam search + BLEU on every 4th evaluation
                metrics["bleu"] = Mean("bleu", "bleu")
            return metrics

    cfg, _ = load_config(str(env["recipe"]))
    check_best_metric(Costly(cfg), "val/top1", with_ema=False)
    with pytest.raises(TkError, match=r"'val/bleu' is not an evaluation result.*results: val/loss, val/top1\)"):
        check_best_metric(Costly(cfg), "val/bleu", with_ema=False)


def test_best_mode_follows_the_metric_unless_given(env):
    from tk.core.engine.train import Trainer
    from tk.core.recipe import load_config

    for overrides, mode in ((["train.best_metric=val/loss"], "min"), (["train.best_metric=val/top1"], "max"),
                            ([], "min"), (["train.best_metric=val/top1", "train.best_mode=min"], "min")):
        cfg, task_cls = load_config(str(env["recipe"]), overrides)
        assert Trainer(cfg, task_cls, None).best_mode == mode, overrides
