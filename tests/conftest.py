"""Shared fixtures: a toy task plugin installed as a real (temporary) distribution."""

from __future__ import annotations

import os
import random
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: threads of two workers on one core thrash (5-10x slower)
    os.environ["OMP_NUM_THREADS"] = "1"  # the runs tests start in subprocesses too
    torch.set_num_threads(1)
# tests never write ~/.cache/tk; each pytest-xdist worker has its own cache (no two builds of one token file at once)
os.environ["TK_CACHE"] = tempfile.mkdtemp(prefix=f"tk-test-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")

TOY_PLUGIN = textwrap.dedent('''
    """A toy task for tk's tests: classify Gaussian blobs with a small MLP."""
    from dataclasses import dataclass

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from tk.core.metrics import Accuracy
    from tk.core.task import StepOutput, Task


    @dataclass
    class ToyData:
        num_train: int = 256  # training samples
        num_val: int = 128  # validation samples
        num_classes: int = 4  # blobs
        dim: int = 8  # features
        noise: float = 0.5  # blob spread
        seed: int = 0  # data seed


    @dataclass
    class ToyModel:
        hidden: int = 32  # hidden width


    class ToyTask(Task):
        """Gaussian-blob classification (test plugin)."""

        name = "toy"
        DataConfig = ToyData
        ModelConfig = ToyModel

        def build_dataset(self, split):
            d = self.data
            g = torch.Generator().manual_seed(d.seed)
            centres = torch.randn(d.num_classes, d.dim, generator=g) * 2
            n = d.num_train if split == "train" else d.num_val
            g.manual_seed(d.seed + (1 if split == "train" else 2))
            labels = torch.randint(0, d.num_classes, (n,), generator=g)
            x = centres[labels] + d.noise * torch.randn(n, d.dim, generator=g)
            return TensorDataset(x, labels)

        def collate(self, samples):
            x, y = torch.utils.data.default_collate(samples)
            return {"x": x, "labels": y}

        def build_model(self):
            d, m = self.data, self.model_cfg
            return nn.Sequential(nn.Linear(d.dim, m.hidden), nn.ReLU(), nn.Linear(m.hidden, d.num_classes))

        def loss(self, model, batch):
            logits = model(batch["x"])
            loss = nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="sum")
            return StepOutput(loss=loss, num_items=batch["labels"].numel(), outputs=logits)

        def build_metrics(self, ctx):
            return {"acc": Accuracy(topk=(1,))}


    @dataclass
    class ToyTokenData:
        num_train: int = 256  # training sequences
        num_val: int = 64  # validation sequences
        vocab_size: int = 16  # token ids 1..vocab_size-1 (0 = PAD)
        min_len: int = 1  # shortest sequence
        max_len: int = 12  # longest sequence
        mask_prob: float = 0.0  # training augmentation: replace input tokens by 0 (numpy RNG)
        delay: float = 0.0  # seconds slept per batch, so tests can signal a run mid-way
        seed: int = 0  # data seed


    @dataclass
    class ToyTokenModel:
        hidden: int = 32  # hidden width
        dropout: float = 0.0  # dropout after the embedding


    class ToyTokenTask(Task):
        """Per-token tagging of variable-length sequences (test plugin; token-level loss)."""

        name = "toy_tokens"
        DataConfig = ToyTokenData
        ModelConfig = ToyTokenModel

        def build_dataset(self, split):
            d = self.data
            g = torch.Generator().manual_seed(d.seed + (1 if split == "train" else 2))
            n = d.num_train if split == "train" else d.num_val
            lengths = torch.randint(d.min_len, d.max_len + 1, (n,), generator=g).tolist()
            return [torch.randint(1, d.vocab_size, (n_tok,), generator=g) for n_tok in lengths]

        def collate(self, samples):
            import time

            if self.data.delay:
                time.sleep(self.data.delay)
            src = nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=0)  # (B, T)
            labels = torch.where(src == 0, torch.full_like(src, -100), (src * 3 + 1) % self.data.vocab_size)
            return {"src": src, "labels": labels}

        def transform_batch(self, batch, training):
            if training and self.data.mask_prob > 0:
                import numpy as np

                drop = torch.from_numpy(np.random.rand(*batch["src"].shape) < self.data.mask_prob)
                batch = {**batch, "src": batch["src"].masked_fill(drop.to(batch["src"].device), 0)}
            return batch

        def build_model(self):
            d, m = self.data, self.model_cfg
            return nn.Sequential(nn.Embedding(d.vocab_size, m.hidden), nn.Dropout(m.dropout),
                                 nn.Linear(m.hidden, m.hidden), nn.Tanh(), nn.Linear(m.hidden, d.vocab_size))

        def loss(self, model, batch):
            logits = model(batch["src"])  # (B, T, V)
            keep = batch["labels"] != -100
            loss = nn.functional.cross_entropy(logits[keep].float(), batch["labels"][keep], reduction="sum")
            correct = (logits[keep].argmax(-1) == batch["labels"][keep]).sum()
            return StepOutput(loss=loss, num_items=keep.sum(), outputs=logits, logs={"acc": correct})

        def build_metrics(self, ctx):
            return {"acc": Accuracy(topk=(1,), ignore_index=-100)}
''')

TOY_RECIPE = textwrap.dedent('''
    # Toy blobs; a few seconds on CPU.
    task: toy
    data: {num_classes: 4}
    model: {hidden: 32}
    optim: {lr: 0.01}
    train: {max_steps: 40, batch_size: 16, eval_every: 20, progress: false}
''')


def make_distribution(site: Path, dist: str, package: str, source: str, entry_points: dict[str, str]) -> Path:
    """Write an installed-looking distribution (package + ``*.dist-info``) into ``site``."""
    (site / package).mkdir(parents=True, exist_ok=True)
    (site / package / "__init__.py").write_text(source)
    # wheel naming: the folder name escapes "-" (importlib.metadata reads the name from it)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[tk.tasks]\n{lines}")
    return site


@pytest.fixture
def toy_site(tmp_path, monkeypatch) -> Path:
    """A temporary site dir on sys.path holding distribution ``tk-toy`` with tasks ``toy``
    (Gaussian blobs, sample-level loss) and ``toy_tokens`` (variable-length sequences,
    token-level loss)."""
    site = make_distribution(tmp_path / "site", "tk-toy", "tk_toy_plugin", TOY_PLUGIN,
                             {"toy": "tk_toy_plugin:ToyTask", "toy_tokens": "tk_toy_plugin:ToyTokenTask"})
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def toy_recipe(tmp_path) -> Path:
    path = tmp_path / "toy.yaml"
    path.write_text(TOY_RECIPE)
    return path


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id named gpu
            item.add_marker(skip_gpu)
