"""The engine measures how long training waits for its batches (``data_wait`` in every training
record) and says once when the loader holds it back (issue #38: a starvation figure that tells
when more workers are needed)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from tk.core.engine.train import Trainer
from tk.core.recipe import load_config
from tk.core.task import StepOutput, Task
from tk.core.training.batches import BatchStream


class SlowLoader:
    """An iterable "loader" whose batches take ``delay`` seconds each."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __iter__(self):
        for i in range(1000):
            time.sleep(self.delay)
            yield i


def test_the_stream_counts_its_waiting_and_says_so_once_after_the_start_up_window():
    lines: list[str] = []
    stream = BatchStream(SlowLoader(0.02), None, echo=lines.append)
    for _ in range(5):
        stream.next()
    waited = stream.pop_wait()
    assert 0.1 <= waited < 2.0 and stream.pop_wait() == 0.0  # five batches of 20 ms; popping resets it
    stream.note_starvation(0.9)  # the first window holds the workers' start-up: nothing said
    stream.note_starvation(0.05)  # below the 10% line
    assert lines == []
    stream.note_starvation(0.5)
    stream.note_starvation(0.6)
    assert len(lines) == 1 and "50% of the time" in lines[0] and "train.num_workers (now 0" in lines[0]


@dataclass
class Blobs:
    delay: float = 0.0  # seconds per item


class BlobSet(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.x = torch.randn(256, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return {"x": self.x[i], "y": int(self.x[i].sum() > 0)}


@dataclass
class Linear:
    width: int = 4


class BlobTask(Task):
    name = "blobs"
    DataConfig = Blobs
    ModelConfig = Linear

    def build_dataset(self, split: str) -> Dataset:
        return BlobSet(self.data.delay if split == "train" else 0.0)

    def build_model(self) -> nn.Module:
        return nn.Linear(self.model_cfg.width, 2)

    def loss(self, model: nn.Module, batch) -> StepOutput:
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
        return StepOutput(loss=loss, num_items=len(batch["y"]))


def run_records(tmp_path, delay: float) -> tuple[list[dict], str]:
    recipe = tmp_path / f"blobs_{delay}.yaml"
    recipe.write_text(f"task: blobs\ndata: {{delay: {delay}}}\noptim: {{name: adamw, lr: 1.0e-2}}\n"
                      f"train: {{max_steps: 24, batch_size: 8, log_every: 6, eval_every: 24, progress: false}}\n")
    cfg, _ = load_config(recipe, task_loader=lambda _name: BlobTask)
    run_dir = tmp_path / f"run_{delay}"
    Trainer(cfg, BlobTask, run_dir=run_dir).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train"], (run_dir / "train.log").read_text()


def test_a_run_fed_by_a_slow_loader_records_its_wait_and_is_told_how_to_fix_it(tmp_path):
    slow, slow_log = run_records(tmp_path, 0.004)  # 32 ms of loading per batch against a tiny model
    fast, fast_log = run_records(tmp_path, 0.0)
    assert len(slow) == 4 and all(0.0 <= r["data_wait"] <= 1.0 for r in slow + fast)
    assert min(r["data_wait"] for r in slow[1:]) > 0.5
    assert sum(r["data_wait"] for r in fast) < sum(r["data_wait"] for r in slow)
    assert slow_log.count("training waited for its batches") == 1 and "train.num_workers" in slow_log
