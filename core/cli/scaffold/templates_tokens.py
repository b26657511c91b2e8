"""``--kind tokens``: one tag per word (core TextEncoder + per-token linear head)."""

from tk.core.cli.scaffold.templates import DATA_HELPERS

DATA = '''\
"""The data of the ``__NAME__`` task: sentences of words, one tag per word.

``data.source: generated`` (the default; offline) makes sentences of the words ``w1 .. wN``:
word ``wK`` has the tag ``t{K % num_tags}``, shifted by one right after the marker ``w1`` (so
the model must look at its neighbour). ``data.source: files`` reads your CoNLL-style files:
``word TAG`` per line, a blank line between sentences.
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

Example = tuple[list[str], list[str]]  # (words, one tag per word)
MARKER = "w1"  # generated: the word that shifts the next word's tag


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["generated", "files"] = "generated"  # generated sentences, or CoNLL-style files (`word TAG` lines)
    train_file: str | None = None  # files: the train split, `word TAG` per line, a blank line between sentences
    val_file: str | None = None  # files: the val split, same format
    num_train: int = 1000  # generated: training sentences
    num_val: int = 200  # generated: validation sentences
    num_tags: int = 5  # generated: tags t0 .. t{num_tags-1}
    num_words: int = 32  # generated: words w1 .. w{num_words-1} (w1 is the marker)
    min_len: int = 4  # generated: shortest sentence (words)
    max_len: int = 16  # generated: longest sentence (words)
    marker_prob: float = 0.2  # generated: chance that a word is the marker
    seed: int = 0  # generated: data seed (the val split uses seed + 1)

    def check(self, prefix: str = "data") -> list[str]:
        problems = []
        if self.source == "files" and not (self.train_file and self.val_file):
            problems.append(f"{prefix}.train_file and {prefix}.val_file: both needed with {prefix}.source: files")
        if not 0.0 <= self.marker_prob < 1.0:
            problems.append(f"{prefix}.marker_prob ({self.marker_prob}) must be in [0, 1)")
        if self.num_tags < 2:
            problems.append(f"{prefix}.num_tags ({self.num_tags}) must be >= 2")
        if self.num_words < 3:
            problems.append(f"{prefix}.num_words ({self.num_words}) must be >= 3 (the marker and one word)")
        if not 1 <= self.min_len <= self.max_len:
            problems.append(f"{prefix}.min_len ({self.min_len}) must be in [1, max_len ({self.max_len})]")
        return problems


def tag_of(words: list[str], num_tags: int) -> list[str]:
    """Word ``wK``'s tag: ``t{K % num_tags}``, or ``t{(K + 1) % num_tags}`` right after the marker."""
    return [f"t{(int(w[1:]) + (i > 0 and words[i - 1] == MARKER)) % num_tags}" for i, w in enumerate(words)]


def generate(d: DataConfig, n: int, seed: int) -> list[Example]:
    """``n`` generated (words, tags) sentences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(d.min_len, d.max_len + 1, (1,), generator=g))
        ids = torch.randint(2, d.num_words, (length,), generator=g)
        ids[torch.rand(length, generator=g) < d.marker_prob] = 1
        words = [f"w{i}" for i in ids.tolist()]
        out.append((words, tag_of(words, d.num_tags)))
    return out


def read_conll(path: str) -> list[Example]:
    """The sentences of a CoNLL-style file: ``word TAG`` per line, a blank line between sentences.

    Raises:
        TkError: an unreadable file, or a line that is not ``word TAG`` (naming file:line).
    """
    out: list[Example] = []
    words: list[str] = []
    tags: list[str] = []
    for number, line in enumerate([*read_lines(path), ""], 1):  # the extra blank line ends the last sentence
        fields = line.split()
        if len(fields) == 2:
            words.append(fields[0])
            tags.append(fields[1])
        elif fields:
            raise TkError(f"{path}:{number}: expected 'word TAG' (two fields), got {line.strip()!r}")
        elif words:
            out.append((words, tags))
            words, tags = [], []
    if not out:
        raise TkError(f"{path}: no sentences; expected 'word TAG' lines, a blank line between sentences")
    return out


def examples(d: DataConfig, split: str) -> list[Example]:
    """The (words, tags) sentences of ``split``: read from its file, or generated."""
    if d.source == "files":
        return read_conll(d.train_file if split == "train" else d.val_file)
    return generate(d, d.num_train, d.seed) if split == "train" else generate(d, d.num_val, d.seed + 1)
''' + DATA_HELPERS

TASK = '''\
"""The ``__NAME__`` task: one tag per word (a core TextEncoder and a linear layer per position).

``setup`` keeps the vocabulary and the tag names as task files (``vocab.json``, ``tags.json``),
so evaluation and ``tk predict`` map words to ids and ids to tag names without the data.
Padded positions get the tag id -100, which the loss and the metric skip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tk.core import Accuracy, EvalContext, Metric, StepOutput, Task, TkError, TransformerConfig, cross_entropy_sum
from tk.core.exchange.backbone import PretrainedBackbone
from tk.core.nn.text_encoder import TextEncoder
from torch import Tensor, nn

from __PKG__.data import DataConfig, build_vocab, examples, pad, task_file

VOCAB_FILE, TAGS_FILE = "vocab.json", "tags.json"  # task files (<run>/artifacts/)
SPECIALS = ["[PAD]", "[UNK]"]  # ids 0 (pads a batch) and 1 (a word the vocabulary lacks)
PAD, UNK = 0, 1
IGNORE = -100  # the tag id of padded positions: no loss, not counted


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's TransformerConfig keys."""

    dim: int = 64  # encoder width D
    depth: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "learned"  # a trained position table (BERT)
    max_len: int = 64  # positions (words): longer sentences are cut
    pretrained_from: str | None = None  # a __NAME__ run to start from (its encoder, shape, vocab.json)


class Tagger(nn.Module):
    """TextEncoder -> (B, T, D) -> linear -> (B, T, num_tags) logits."""

    def __init__(self, encoder: TextEncoder, num_tags: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.cfg.dim, num_tags)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) long, PAD = 0 -> logits (B, T, num_tags)."""
        return self.head(self.encoder(tokens))


class __CLASS__(Task):
    """__NAME__: one tag per word (generated sentences or CoNLL-style files)."""

    name = "__NAME__"
    DataConfig = DataConfig
    ModelConfig = ModelConfig
    # model.pretrained_from: the engine checks the source run, adopts its shape, copies its vocab.json (the
    # same ids) before setup and its encoder.* tensors after build_model; the head stays new
    pretrained_backbone = PretrainedBackbone(prefix="encoder.", files=(VOCAB_FILE,))

    def setup(self, resume: bool = False) -> None:
        """The vocabulary and tag names: built from the train split once, then read back from the task files."""
        train = lambda: examples(self.data, "train")  # noqa: E731  (read only when a file is missing)
        self.vocab = task_file(self.files, VOCAB_FILE, lambda: build_vocab([w for w, _ in train()], SPECIALS), resume)
        self.tags = task_file(self.files, TAGS_FILE, lambda: sorted({t for _, ts in train() for t in ts}), resume)
        self.ids = {word: i for i, word in enumerate(self.vocab)}

    def encode(self, words: Sequence[str]) -> list[int]:
        """Word ids (UNK for a word the vocabulary lacks), cut to ``model.max_len``."""
        return [self.ids.get(w, UNK) for w in words[: self.model_cfg.max_len]]

    def build_dataset(self, split: str) -> list[dict[str, list[int]]]:
        data, tag_id = examples(self.data, split), {t: i for i, t in enumerate(self.tags)}
        unknown = sorted({t for _, tags in data for t in tags} - tag_id.keys())
        if unknown:
            raise TkError(f"{split} split: tags {unknown} are not among the train split's tags {self.tags}")
        if cut := sum(len(words) > self.model_cfg.max_len for words, _ in data):
            self.report(f"{split}: {cut} sentences longer than model.max_len ({self.model_cfg.max_len}) are cut")
        return [{"tokens": self.encode(words), "tags": [tag_id[t] for t in tags[: self.model_cfg.max_len]]}
                for words, tags in data]

    def collate(self, samples: list[dict]) -> dict[str, Tensor]:
        """Pad to the batch's longest sentence: {"tokens": (B, T), "tags": (B, T), -100 at PAD}."""
        return {"tokens": pad([s["tokens"] for s in samples], PAD), "tags": pad([s["tags"] for s in samples], IGNORE)}

    def build_model(self) -> nn.Module:
        encoder = TextEncoder(TransformerConfig.of(self.model_cfg), len(self.vocab), type_vocab_size=0, pad_id=PAD)
        return Tagger(encoder, len(self.tags))

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Cross-entropy summed over the non-PAD words, with their count (a word-level loss)."""
        logits = model(batch["tokens"])
        loss, count = cross_entropy_sum(logits, batch["tags"], ignore_index=IGNORE)
        return StepOutput(loss=loss, num_items=count, outputs=logits.detach())

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"acc": Accuracy(topk=(1,), target_key="tags", ignore_index=IGNORE)}  # key val/top1

    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """``tk predict RUN "w7 w1 w3"``: a line of space-separated words -> {"tags": a tag name per word}."""
        out, device, max_len = [], next(model.parameters()).device, self.model_cfg.max_len
        for line in inputs:  # one sentence at a time: no padding, so a row never depends on its batch
            words = line.split()
            if not 0 < len(words) <= max_len:
                problem = f"{len(words)} words, more than model.max_len ({max_len})" if words else "no words"
                out.append({"error": f"{line!r}: {problem}"})
                continue
            logits = model(torch.tensor([self.encode(words)], device=device))[0]  # (T, num_tags)
            out.append({"tags": [self.tags[i] for i in logits.argmax(-1).tolist()]})
        return out

    def example_inputs(self, model: nn.Module) -> dict[str, Tensor]:
        """``tk export --format torch-export|onnx``: a padded batch of two sentences (any ids trace the same graph)."""
        return {"tokens": torch.tensor([[UNK, UNK, UNK], [UNK, PAD, PAD]])}
'''

RECIPE = '''\
# __NAME__ on generated sentences (tokens): a 2-layer encoder tags each word, under a minute on a CPU.
# Measured: val/top1 1.000 after 300 updates, 7 s on an idle 2-core CPU (seed 0).
#   tk run __RECIPE__
# Your data: tk run __RECIPE__ data.source=files data.train_file=train.txt data.val_file=val.txt
#   (CoNLL-style: `word TAG` per line, a blank line between sentences)
task: __NAME__
data: {source: generated, num_train: 2000, num_val: 200, num_tags: 5, num_words: 32, seed: 0}
model: {dim: 64, depth: 2, num_heads: 4, dropout: 0.0}
optim: {name: adamw, lr: 3.0e-3, weight_decay: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 20}
train: {max_steps: 300, batch_size: 32, eval_every: 100, best_metric: val/top1, seed: 0, log_every: 50}
output_dir: runs/__RECIPE__
'''

README_EXTRA = '''
## Data

`data.source: files` reads CoNLL-style text files, `word TAG` per line and a blank line
between sentences (a bad line is one error naming `file:line`):

```text
Alice B-PER
visits O
Paris B-LOC

Bob B-PER
```

`tk predict runs/__RECIPE__ "w7 w1 w3"` tags each space-separated word: `{"tags": [...]}`.
'''

TEST_HEAD = '''\
from __PKG__.data import generate, read_conll, tag_of

INPUTS = ["w7 w1 w3 w3", "w2 unseen"]  # raw inputs as a user types them: space-separated words
BACKBONE = "encoder."  # what model.pretrained_from copies (the rest, the head, stays new)
'''

TEST_EXTRA = '''

def test_predict_gives_a_tag_name_per_word(run):
    rows = testing.check_predict(run, INPUTS)
    tags = json.loads((run / "artifacts" / "tags.json").read_text())
    assert [len(r["tags"]) for r in rows] == [4, 2] and {t for r in rows for t in r["tags"]} <= set(tags)


def test_tags_by_hand():
    # w7: 7 % 5 = 2; w1 (the marker) itself: 1; after it w3: (3 + 1) % 5 = 4; then w3: 3
    assert tag_of(["w7", "w1", "w3", "w3"], 5) == ["t2", "t1", "t4", "t3"]
    assert all(len(w) == len(t) for w, t in generate(__CLASS__.DataConfig(), 20, seed=1))


def test_file_reader(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("Alice B-PER\\nvisits O\\n\\n\\nBob B-PER\\n")
    assert read_conll(str(path)) == [(["Alice", "visits"], ["B-PER", "O"]), (["Bob"], ["B-PER"])]
    path.write_text("Alice B-PER\\nvisits\\n")
    with pytest.raises(TkError, match=f"^{re.escape(str(path))}:2: expected 'word TAG'"):
        read_conll(str(path))
'''
