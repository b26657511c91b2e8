"""``--kind classification``: one label per text (core TextEncoder + pooled linear head)."""

from tk.core.cli.scaffold.templates import DATA_HELPERS

DATA = '''\
"""The data of the ``__NAME__`` task: texts (words), one label per text.

``data.source: generated`` (the default; offline) makes texts of the words ``w1 .. wN`` in which
the word of the text's class (``w{c+1}`` for ``class{c}``) occurs more often than any other
class's word. ``data.source: files`` reads your files: ``label<TAB>text`` per line.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tk.core import TaskFiles, TkError

Example = tuple[list[str], str]  # (words, label)


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["generated", "files"] = "generated"  # generated texts, or files of `label<TAB>text` lines
    train_file: str | None = None  # files: the train split, `label<TAB>text` per line (words split at spaces)
    val_file: str | None = None  # files: the val split, same format
    num_train: int = 1000  # generated: training texts
    num_val: int = 200  # generated: validation texts
    num_classes: int = 4  # generated: labels class0 .. class{num_classes-1}, marked by the words w1 .. w{num_classes}
    num_words: int = 32  # generated: words w1 .. w{num_words-1}
    min_len: int = 6  # generated: shortest text (words)
    max_len: int = 16  # generated: longest text (words)
    seed: int = 0  # generated: data seed (the val split uses seed + 1)

    def check(self, prefix: str = "data") -> list[str]:
        problems = []
        if self.source == "files" and not (self.train_file and self.val_file):
            problems.append(f"{prefix}.train_file and {prefix}.val_file: both needed with {prefix}.source: files")
        if self.num_classes < 2:
            problems.append(f"{prefix}.num_classes ({self.num_classes}) must be >= 2")
        if self.num_words < self.num_classes + 2:
            problems.append(f"{prefix}.num_words ({self.num_words}) must be >= num_classes + 2 "
                            f"({self.num_classes + 2}): one word per class and filler words")
        if not 3 <= self.min_len <= self.max_len:
            problems.append(f"{prefix}.min_len ({self.min_len}) must be in [3, max_len ({self.max_len})]")
        return problems


def generate(d: DataConfig, n: int, seed: int) -> list[Example]:
    """``n`` generated (words, label) texts: ``class{c}``'s word ``w{c+1}`` is the most frequent class word."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(d.min_len, d.max_len + 1, (1,), generator=g))
        label = int(torch.randint(0, d.num_classes, (1,), generator=g))
        ids = torch.randint(d.num_classes + 1, d.num_words, (length,), generator=g)
        marks = torch.randperm(length, generator=g)[: max(3, length // 3)]
        ids[marks[:-1]] = label + 1  # the class word, at least once more than ...
        other = int(torch.randint(0, d.num_classes, (1,), generator=g))
        ids[marks[-1]] = other + 1  # ... one distractor (maybe the class word again)
        out.append(([f"w{i}" for i in ids.tolist()], f"class{label}"))
    return out


def read_tsv(path: str) -> list[Example]:
    """The texts of a file of ``label<TAB>text`` lines (blank lines are skipped).

    Raises:
        TkError: an unreadable file, or a line without a label, a tab and a text (naming file:line).
    """
    out = []
    for number, line in enumerate(read_lines(path), 1):
        label, tab, text = line.partition("\\t")
        if tab and label.strip() and text.split():
            out.append((text.split(), label.strip()))
        elif line.strip():
            raise TkError(f"{path}:{number}: expected 'label<TAB>text', got {line.strip()!r}")
    if not out:
        raise TkError(f"{path}: no texts; expected 'label<TAB>text' per line")
    return out


def examples(d: DataConfig, split: str) -> list[Example]:
    """The (words, label) texts of ``split``: read from its file, or generated."""
    if d.source == "files":
        return read_tsv(d.train_file if split == "train" else d.val_file)
    return generate(d, d.num_train, d.seed) if split == "train" else generate(d, d.num_val, d.seed + 1)
''' + DATA_HELPERS

TASK = '''\
"""The ``__NAME__`` task: one label per text (a core TextEncoder, pooled, and a linear layer).

``setup`` keeps the vocabulary and the label names as task files (``vocab.json``,
``labels.json``), so evaluation and ``tk predict`` map words to ids and ids to label names
without the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tk.core import Accuracy, EvalContext, Metric, StepOutput, Task, TkError, TransformerConfig, cross_entropy_sum
from tk.core.exchange.backbone import PretrainedBackbone
from tk.core.nn.text_encoder import TextEncoder, pool
from torch import Tensor, nn

from __PKG__.data import DataConfig, build_vocab, examples, pad, task_file

VOCAB_FILE, LABELS_FILE = "vocab.json", "labels.json"  # task files (<run>/artifacts/)
SPECIALS = ["[PAD]", "[UNK]"]  # ids 0 (pads a batch) and 1 (a word the vocabulary lacks)
PAD, UNK = 0, 1


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's TransformerConfig keys plus the head's."""

    dim: int = 64  # encoder width D
    depth: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "learned"  # a trained position table (BERT)
    max_len: int = 64  # positions (words): longer texts are cut
    pooling: Literal["cls", "mean", "max"] = "mean"  # text vector: "cls" (first word), "mean" or "max" over its words
    pretrained_from: str | None = None  # a __NAME__ run to start from (its encoder, shape, vocab.json)


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
    """__NAME__: one label per text (generated texts or label<TAB>text files)."""

    name = "__NAME__"
    DataConfig = DataConfig
    ModelConfig = ModelConfig
    # model.pretrained_from: the engine checks the source run, adopts its shape, copies its vocab.json (the
    # same ids) before setup and its encoder.* tensors after build_model; the head stays new
    pretrained_backbone = PretrainedBackbone(prefix="encoder.", files=(VOCAB_FILE,))

    def setup(self, resume: bool = False) -> None:
        """The vocabulary and label names: built from the train split once, then read back from the task files."""
        train = lambda: examples(self.data, "train")  # noqa: E731  (read only when a file is missing)
        self.vocab = task_file(self.files, VOCAB_FILE, lambda: build_vocab([w for w, _ in train()], SPECIALS), resume)
        self.labels = task_file(self.files, LABELS_FILE, lambda: sorted({label for _, label in train()}), resume)
        self.ids = {word: i for i, word in enumerate(self.vocab)}

    def encode(self, words: Sequence[str]) -> list[int]:
        """Word ids (UNK for a word the vocabulary lacks), cut to ``model.max_len``."""
        return [self.ids.get(w, UNK) for w in words[: self.model_cfg.max_len]]

    def build_dataset(self, split: str) -> list[dict[str, Any]]:
        data, label_id = examples(self.data, split), {label: i for i, label in enumerate(self.labels)}
        unknown = sorted({label for _, label in data} - label_id.keys())
        if unknown:
            raise TkError(f"{split} split: labels {unknown} are not among the train split's labels {self.labels}")
        if cut := sum(len(words) > self.model_cfg.max_len for words, _ in data):
            self.report(f"{split}: {cut} texts longer than model.max_len ({self.model_cfg.max_len}) are cut")
        return [{"tokens": self.encode(words), "label": label_id[label]} for words, label in data]

    def collate(self, samples: list[dict]) -> dict[str, Tensor]:
        """Pad to the batch's longest text: {"tokens": (B, T), "labels": (B,)}."""
        return {"tokens": pad([s["tokens"] for s in samples], PAD),
                "labels": torch.tensor([s["label"] for s in samples])}

    def build_model(self) -> nn.Module:
        encoder = TextEncoder(TransformerConfig.of(self.model_cfg), len(self.vocab), type_vocab_size=0, pad_id=PAD)
        return Classifier(encoder, len(self.labels), self.model_cfg.pooling)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Cross-entropy summed over the batch (the engine divides by the total count)."""
        logits = model(batch["tokens"])
        loss, count = cross_entropy_sum(logits, batch["labels"])
        return StepOutput(loss=loss, num_items=count, outputs=logits.detach())

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"acc": Accuracy(topk=(1,))}  # key val/top1

    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """``tk predict RUN "w1 w9 w1"``: a text (its words split at spaces) -> {"label": a name, "score": its
        probability}."""
        out, device = [], next(model.parameters()).device
        for text in inputs:  # one text at a time: no padding, so a row never depends on its batch
            if not text.split():
                out.append({"error": f"{text!r}: an empty text"})
                continue
            probs = model(torch.tensor([self.encode(text.split())], device=device))[0].float().softmax(-1)
            out.append({"label": self.labels[int(probs.argmax())], "score": round(float(probs.max()), 4)})
        return out

    def example_inputs(self, model: nn.Module) -> dict[str, Tensor]:
        """``tk export --format torch-export|onnx``: a padded batch of two texts (any ids trace the same graph)."""
        return {"tokens": torch.tensor([[UNK, UNK, UNK], [UNK, PAD, PAD]])}
'''

RECIPE = '''\
# __NAME__ on generated texts (classification): a 2-layer encoder, under a minute on a CPU.
# Measured: val/top1 1.000 after 300 updates, 7 s on an idle 2-core CPU (seed 0).
#   tk run __RECIPE__
# Your data: tk run __RECIPE__ data.source=files data.train_file=train.tsv data.val_file=val.tsv
#   (`label<TAB>text` per line)
task: __NAME__
data: {source: generated, num_train: 2000, num_val: 200, num_classes: 4, num_words: 32, seed: 0}
model: {dim: 64, depth: 2, num_heads: 4, dropout: 0.0}
optim: {name: adamw, lr: 1.0e-3, weight_decay: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 20}
train: {max_steps: 300, batch_size: 32, eval_every: 100, best_metric: val/top1, seed: 0, log_every: 50}
output_dir: runs/__RECIPE__
'''

README_EXTRA = '''
## Data

`data.source: files` reads text files of `label<TAB>text` lines, the text's words split at
spaces (blank lines are skipped; a bad line is one error naming `file:line`):

```text
positive\ta fine film
negative\tdull and long
```

`tk predict runs/__RECIPE__ "w1 w9 w1"` labels each text: `{"label": ..., "score": ...}`.
'''

TEST_HEAD = '''\
from __PKG__.data import generate, read_tsv

INPUTS = ["w1 w9 w1 w12 w1", "w3 unseen w3"]  # raw inputs as a user types them: texts
BACKBONE = "encoder."  # what model.pretrained_from copies (the rest, the head, stays new)
'''

TEST_EXTRA = '''

def test_predict_gives_a_label_name_per_text(run):
    rows = testing.check_predict(run, INPUTS)
    labels = json.loads((run / "artifacts" / "labels.json").read_text())
    assert all(r["label"] in labels and 0 < r["score"] <= 1 for r in rows)


def test_generated_label_is_the_most_frequent_class_word():
    d = __CLASS__.DataConfig()
    for words, label in generate(d, 50, seed=3):
        counts = [words.count(f"w{c + 1}") for c in range(d.num_classes)]
        assert label == f"class{counts.index(max(counts))}" and counts.count(max(counts)) == 1


def test_file_reader(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("positive\\ta fine film\\n\\nnegative\\tdull\\n")
    assert read_tsv(str(path)) == [(["a", "fine", "film"], "positive"), (["dull"], "negative")]
    path.write_text("positive\\ta fine film\\nnegative dull\\n")
    with pytest.raises(TkError, match=f"^{re.escape(str(path))}:2: expected 'label<TAB>text'"):
        read_tsv(str(path))
'''
