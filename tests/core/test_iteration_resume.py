"""Iteration-based training and resume without replay: a run on endless random batches
(no ``len(loader)``, no epochs) killed with SIGKILL and resumed logs the same per-step
losses and ends with the same weights as an uninterrupted run, and the resumed run loads
no item of the batches it skips; token-budget passes resume the same way; loaders
without a length need ``train.max_steps``; an IterableDataset trains."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tk.core import TkError
from tk.core.cli import cli
from tk.core.engine.train import Trainer
from tk.core.recipe import load_config
from tk.core.run.checkpoint import load_checkpoint

from ..conftest import make_distribution
from .toy_text import FETCH_LOG

TOY_TEXT = Path(__file__).with_name("toy_text.py").read_text()
# random batches with masking (numpy) and dropout; grad_accum=2: 2 micro-batches of 8 per step
RECIPE = """\
task: toy_text
data: {num_train: 200, num_val: 32, batching: random, mask_prob: 0.1}
model: {hidden: 32, dropout: 0.1}
optim: {lr: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 4}
train: {max_steps: 16, batch_size: 8, grad_accum: 2, eval_every: 6, log_every: 1, progress: false,
        deterministic: true}
"""
TK = str(Path(sys.executable).with_name("tk"))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The toy_text plugin on sys.path, the recipe, and an uninterrupted run with its fetch log."""
    root = tmp_path_factory.mktemp("iteration")
    site = make_distribution(root / "site", "tk-toy-text", "tk_toy_text", TOY_TEXT,
                             {"toy_text": "tk_toy_text:ToyTextTask"})
    sys.path.insert(0, str(site))
    recipe = root / "text.yaml"
    recipe.write_text(RECIPE)
    reference = root / "reference"
    os.environ[FETCH_LOG] = str(root / "reference.fetched")
    try:
        result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={reference}"], catch_exceptions=False)
    finally:
        del os.environ[FETCH_LOG]
    assert result.exit_code == 0, result.output
    yield {"root": root, "site": site, "recipe": recipe, "reference": reference}
    sys.path.remove(str(site))
    torch.use_deterministic_algorithms(False)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def fetched(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_reference_run_has_no_epochs(env):
    recs = records(env["reference"])
    assert [r["step"] for r in recs if r["split"] == "val"] == [6, 12, 16]  # eval_every, then the end
    assert all(r["epoch"] is None for r in recs)
    assert len(fetched(env["root"] / "reference.fetched")) == 16 * 2 * 8  # train items, loaded once each


def test_sigkill_and_resume_is_exact_and_loads_no_skipped_item(env, monkeypatch):
    run_dir = env["root"] / "killed"
    path = os.pathsep.join([str(env["site"])] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.Popen([TK, "run", str(env["recipe"]), f"output_dir={run_dir}", "train.save_every=1",
                             "data.delay=0.05"], env={**os.environ, "PYTHONPATH": path},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # step 9's file exists only after last.pt points to step 8 or later
    while not (run_dir / "checkpoints" / "step_00000009.pt").exists():
        assert proc.poll() is None, f"the run ended before the test could kill it: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    killed_at = state["step"]
    assert 8 <= killed_at < 16 and state["data"] == {"epoch": 0, "batch": 2 * killed_at}

    log = env["root"] / "resumed.fetched"
    monkeypatch.setenv(FETCH_LOG, str(log))
    result = CliRunner().invoke(cli, ["run", str(env["recipe"]), f"output_dir={run_dir}", "--resume"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    train = [(r["step"], r["loss"]) for r in records(run_dir) if r["split"] == "train"]
    assert train == [(r["step"], r["loss"]) for r in records(env["reference"]) if r["split"] == "train"]
    ours, ref = load_file(run_dir / "model.safetensors"), load_file(env["reference"] / "model.safetensors")
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    skipped = killed_at * 2 * 8  # items of the consumed micro-batches
    assert fetched(log) == fetched(env["root"] / "reference.fetched")[skipped:]  # none of them loaded


def make_trainer(env, run_dir, *overrides):
    cfg, task_cls = load_config(env["recipe"], ["train.deterministic=false", *overrides])
    return Trainer(cfg, task_cls, run_dir)


def test_token_budget_pass_resumes_mid_pass_without_loading(env, monkeypatch, tmp_path):
    tokens = ["data.batching=tokens", "data.max_tokens=96", "train.max_steps=30", "train.eval_every=100"]
    ref = make_trainer(env, None, *tokens)
    per_epoch = ref.steps_per_epoch
    assert per_epoch < 30 // 2  # the run crosses at least two pass boundaries
    reference = [ref.train_step()["loss"] for _ in range(30)]

    first = make_trainer(env, None, *tokens)
    for _ in range(per_epoch + 3):  # into pass 1
        first.train_step()
    state = first.state_dict()
    assert state["data"] == {"epoch": 1, "batch": 6}
    monkeypatch.setenv(FETCH_LOG, str(tmp_path / "fetched"))
    second = make_trainer(env, None, *tokens)
    second.load_state_dict(state)
    rest = [second.train_step()["loss"] for _ in range(30 - per_epoch - 3)]
    assert rest == reference[per_epoch + 3:]
    sampler = second.train_loader.batch_sampler
    sampler.set_epoch(1)
    first_batches = sampler.pass_batches()[6:8]  # one process: all batches are its own
    assert fetched(tmp_path / "fetched")[:sum(map(len, first_batches))] == [i for b in first_batches for i in b]


def test_loader_without_length_needs_max_steps(env):
    cfg, task_cls = load_config(env["recipe"], ["train.max_steps=null", "train.epochs=2"])
    with pytest.raises(TkError, match=r"^train.max_steps: the train loader has no length"):
        Trainer(cfg, task_cls, None)


def test_iterable_dataset_trains_with_max_steps(env, tmp_path):
    # 200 sequences / 8 = 25 batches per pass (unknown to the engine): 15 steps x 2 cross a pass
    trainer = make_trainer(env, tmp_path / "iterable", "data.batching=iterable", "train.max_steps=15",
                           "train.eval_every=null")
    assert trainer.steps_per_epoch is None
    results = trainer.fit()
    assert trainer.batches.epoch == 1 and "val/loss" in results
    recs = records(tmp_path / "iterable")
    assert [r["step"] for r in recs if r["split"] == "val"] == [15]  # no epochs: evaluated at the end
