"""``--kind classification``: one label per token sequence (core TextEncoder + pooled linear head)."""

TASK = '''\
"""The ``__NAME__`` task: one label per token sequence.

The example data is generated: a sequence of random tokens in which the token of its
class (id ``label + 1``) appears more often than any other class token. Replace
``make_examples`` (and the ``data:`` keys) with your own data; the engine does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tk.core import Accuracy, EvalContext, Metric, StepOutput, Task, TransformerConfig, cross_entropy_sum
from tk.core.nn.text_encoder import TextEncoder, pool
from torch import Tensor, nn
from torch.utils.data import Dataset

PAD = 0  # token id 0 pads a batch; real tokens are 1..vocab_size-1


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    num_train: int = 1000  # generated training sequences
    num_val: int = 200  # generated validation sequences
    num_classes: int = 4  # labels 0..num_classes-1; class c is marked by token id c + 1
    vocab_size: int = 32  # token ids 0..vocab_size-1 (0 = PAD)
    min_len: int = 6  # shortest sequence (tokens)
    max_len: int = 16  # longest sequence (tokens)
    seed: int = 0  # data seed (the val split uses seed + 1)

    def check(self, prefix: str = "data") -> list[str]:
        problems = []
        if self.num_classes < 2:
            problems.append(f"{prefix}.num_classes ({self.num_classes}) must be >= 2")
        if self.vocab_size < self.num_classes + 2:
            problems.append(f"{prefix}.vocab_size ({self.vocab_size}) must be >= num_classes + 2 "
                            f"({self.num_classes + 2}): PAD, one token per class and filler tokens")
        if not 3 <= self.min_len <= self.max_len:
            problems.append(f"{prefix}.min_len ({self.min_len}) must be in [3, max_len ({self.max_len})]")
        return problems


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's TransformerConfig keys plus the head's."""

    dim: int = 64  # encoder width D
    depth: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "learned"  # a trained position table (BERT)
    pooling: Literal["cls", "mean", "max"] = "mean"  # sequence vector: "cls" (first token), "mean" or "max" over non-PAD tokens


def make_examples(d: DataConfig, n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` generated (token ids, label) pairs: label c's token (c + 1) is the most frequent class token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(d.min_len, d.max_len + 1, (1,), generator=g))
        label = int(torch.randint(0, d.num_classes, (1,), generator=g))
        tokens = torch.randint(d.num_classes + 1, d.vocab_size, (length,), generator=g)
        marks = torch.randperm(length, generator=g)[: max(3, length // 3)]
        tokens[marks[:-1]] = label + 1  # the class token, at least once more than ...
        other = int(torch.randint(0, d.num_classes, (1,), generator=g))
        tokens[marks[-1]] = other + 1 if other != label else label + 1  # ... one distractor
        out.append((tokens.tolist(), label))
    return out


class ExampleDataset(Dataset):
    """Items ``{"tokens": list[int], "label": int}``."""

    def __init__(self, examples: list[tuple[list[int], int]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        tokens, label = self.examples[i]
        return {"tokens": tokens, "label": label}


class Classifier(nn.Module):
    """TextEncoder -> pooled (B, D) -> linear -> (B, C) logits."""

    def __init__(self, encoder: TextEncoder, num_classes: int, pooling: str) -> None:
        super().__init__()
        self.encoder, self.pooling = encoder, pooling
        self.head = nn.Linear(encoder.cfg.dim, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) long, PAD = 0 -> logits (B, C)."""
        mask = self.encoder.padding_mask(tokens)
        return self.head(pool(self.encoder(tokens, key_padding_mask=mask), mask, self.pooling))


class __CLASS__(Task):
    """__NAME__: one label per token sequence (generated example data)."""

    name = "__NAME__"
    DataConfig = DataConfig
    ModelConfig = ModelConfig

    def build_dataset(self, split: str) -> Dataset:
        d = self.data
        n, seed = (d.num_train, d.seed) if split == "train" else (d.num_val, d.seed + 1)
        return ExampleDataset(make_examples(d, n, seed))

    def collate(self, samples: list[dict]) -> dict[str, Tensor]:
        """Pad to the batch's longest sequence: {"tokens": (B, T), "labels": (B,)}."""
        tokens = nn.utils.rnn.pad_sequence([torch.tensor(s["tokens"]) for s in samples], batch_first=True,
                                           padding_value=PAD)
        return {"tokens": tokens, "labels": torch.tensor([s["label"] for s in samples])}

    def build_model(self) -> nn.Module:
        m, d = self.model_cfg, self.data
        # the model section's shape fields; positions: as many as the longest sequence
        cfg = TransformerConfig.of(m, max_len=d.max_len)
        return Classifier(TextEncoder(cfg, d.vocab_size, type_vocab_size=0, pad_id=PAD), d.num_classes, m.pooling)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Cross-entropy summed over the batch (the engine divides by the total count)."""
        logits = model(batch["tokens"])
        loss, count = cross_entropy_sum(logits, batch["labels"])
        return StepOutput(loss=loss, num_items=count, outputs=logits.detach())

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"acc": Accuracy(topk=(1,))}  # key val/top1
'''

RECIPE = '''\
# __NAME__ on generated sequences (classification): a 2-layer encoder, under a minute on a CPU.
# Measured: val/top1 1.000 after 300 updates, 17 s on a 2-core CPU under load (seed 0).
#   tk run __RECIPE__
task: __NAME__
data: {num_train: 2000, num_val: 200, num_classes: 4, vocab_size: 32, seed: 0}
model: {dim: 64, depth: 2, num_heads: 4, dropout: 0.0}
optim: {name: adamw, lr: 1.0e-3, weight_decay: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 20}
train: {max_steps: 300, batch_size: 32, eval_every: 100, best_metric: val/top1, seed: 0, log_every: 50}
output_dir: runs/__RECIPE__
'''

README_EXTRA = ""

TEST_EXTRA = '''

def test_generated_label_is_the_most_frequent_class_token():
    d = __CLASS__.DataConfig()
    for tokens, label in make_examples(d, 50, seed=3):
        counts = [tokens.count(c + 1) for c in range(d.num_classes)]
        assert counts[label] == max(counts) and counts.count(max(counts)) == 1
'''
