"""``--kind seq2seq``: an output sequence per input sequence (core EncoderDecoder)."""

from tk.core.cli.scaffold.templates import DATA_HELPERS

DATA = '''\
"""The data of the ``__NAME__`` task: pairs of word sequences (source -> target).

``data.source: generated`` (the default; offline) makes sources of the words ``w0 .. wN``
whose target is the source reversed. ``data.source: files`` reads your files:
``source<TAB>target`` per line, each a sequence of words split at spaces.
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

Example = tuple[list[str], list[str]]  # (source words, target words)


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["generated", "files"] = "generated"  # generated pairs, or files of `source<TAB>target` lines
    train_file: str | None = None  # files: the train split, `source<TAB>target` per line (words split at spaces)
    val_file: str | None = None  # files: the val split, same format
    num_train: int = 1000  # generated: training pairs
    num_val: int = 100  # generated: validation pairs
    num_words: int = 13  # generated: words w0 .. w{num_words-1}
    min_len: int = 2  # generated: shortest source (words)
    max_len: int = 8  # generated: longest source (words)
    seed: int = 0  # generated: data seed (the val split uses seed + 1)

    def check(self, prefix: str = "data") -> list[str]:
        problems = []
        if self.source == "files" and not (self.train_file and self.val_file):
            problems.append(f"{prefix}.train_file and {prefix}.val_file: both needed with {prefix}.source: files")
        if self.num_words < 1:
            problems.append(f"{prefix}.num_words ({self.num_words}) must be >= 1")
        if not 1 <= self.min_len <= self.max_len:
            problems.append(f"{prefix}.min_len ({self.min_len}) must be in [1, max_len ({self.max_len})]")
        return problems


def generate(d: DataConfig, n: int, seed: int) -> list[Example]:
    """``n`` generated (source, target) pairs: the target is the source reversed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(d.min_len, d.max_len + 1, (1,), generator=g))
        src = [f"w{i}" for i in torch.randint(0, d.num_words, (length,), generator=g).tolist()]
        out.append((src, src[::-1]))
    return out


def read_tsv(path: str) -> list[Example]:
    """The pairs of a file of ``source<TAB>target`` lines (blank lines are skipped).

    Raises:
        TkError: an unreadable file, or a line without a source, a tab and a target (naming file:line).
    """
    out = []
    for number, line in enumerate(read_lines(path), 1):
        src, tab, tgt = line.partition("\\t")
        if tab and src.split() and tgt.split():
            out.append((src.split(), tgt.split()))
        elif line.strip():
            raise TkError(f"{path}:{number}: expected 'source<TAB>target', got {line.strip()!r}")
    if not out:
        raise TkError(f"{path}: no pairs; expected 'source<TAB>target' per line")
    return out


def examples(d: DataConfig, split: str) -> list[Example]:
    """The (source, target) pairs of ``split``: read from its file, or generated."""
    if d.source == "files":
        return read_tsv(d.train_file if split == "train" else d.val_file)
    return generate(d, d.num_train, d.seed) if split == "train" else generate(d, d.num_val, d.seed + 1)
''' + DATA_HELPERS

TASK = '''\
"""The ``__NAME__`` task: one output sequence per input sequence (the core EncoderDecoder).

Training is teacher forced (``tgt_in`` = BOS + target predicts ``tgt_out`` = target + EOS);
evaluation also decodes greedily and counts exact matches. ``setup`` keeps the vocabulary, one
for sources and targets, as a task file (``vocab.json``), so evaluation and ``tk predict`` map
words to ids and back without the data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tk.core import (
    Accuracy,
    EncoderDecoder,
    EvalContext,
    Metric,
    StepOutput,
    Task,
    TransformerConfig,
    cross_entropy_sum,
    greedy_decode,
)
from tk.core.exchange.backbone import PretrainedBackbone
from torch import Tensor, nn

from __PKG__.data import DataConfig, build_vocab, examples, pad, task_file

VOCAB_FILE = "vocab.json"  # task file (<run>/artifacts/)
SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]  # ids 0..3; [UNK]: a word the vocabulary lacks
PAD, BOS, EOS, UNK = 0, 1, 2, 3
IGNORE = -100  # target of padded positions: no loss, not counted


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's TransformerConfig keys (encoder and decoder)."""

    dim: int = 64  # model width D
    depth: int = 2  # encoder and decoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    max_len: int = 64  # positions (words): longer sources are cut, and targets to max_len - 1 (BOS, EOS)
    pretrained_from: str | None = None  # a __NAME__ run to start from (all its weights, shape, vocab.json)


class ExactMatch(Metric):
    """Fraction of sequences whose greedy output equals the target exactly (key ``exact_match``)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", torch.zeros((), dtype=torch.long))
        self.add_state("total", torch.zeros((), dtype=torch.long))

    def keys(self) -> list[str]:
        return ["exact_match"]

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        hyp = out.outputs["hyp"]  # (B, T') greedy ids, EOS then PAD
        ref = batch["tgt_out"]  # (B, T) target + EOS, IGNORE at PAD
        ref = ref.masked_fill(ref == IGNORE, PAD)
        T = max(hyp.shape[1], ref.shape[1])
        hyp = nn.functional.pad(hyp, (0, T - hyp.shape[1]), value=PAD).to(ref.device)
        ref = nn.functional.pad(ref, (0, T - ref.shape[1]), value=PAD)
        self.correct += (hyp == ref).all(1).sum().to(self.correct.device)
        self.total += ref.shape[0]

    def compute(self) -> dict[str, float]:
        return {"exact_match": float(self.correct) / max(int(self.total), 1)}


class __CLASS__(Task):
    """__NAME__: one output sequence per input (generated pairs or source<TAB>target files)."""

    name = "__NAME__"
    DataConfig = DataConfig
    ModelConfig = ModelConfig
    # model.pretrained_from: the engine checks the source run, adopts its shape, copies its vocab.json (the
    # same ids) before setup and all its tensors (prefix "": the whole model) after build_model
    pretrained_backbone = PretrainedBackbone(prefix="", files=(VOCAB_FILE,))

    @classmethod
    def check_config(cls, cfg) -> list[str]:
        d, m = cfg.sections["data"], cfg.sections["model"]
        if d.source == "generated" and m.max_len <= d.max_len:
            return [f"model.max_len ({m.max_len}) must exceed data.max_len ({d.max_len}): targets get BOS/EOS"]
        return []

    def setup(self, resume: bool = False) -> None:
        """The vocabulary: built from the train split once, then read back from the task file."""
        build = lambda: build_vocab([s + t for s, t in examples(self.data, "train")], SPECIALS)  # noqa: E731
        self.vocab = task_file(self.files, VOCAB_FILE, build, resume)
        self.ids = {word: i for i, word in enumerate(self.vocab)}

    def encode(self, words: Sequence[str], limit: int) -> list[int]:
        """Word ids (UNK for a word the vocabulary lacks), cut to ``limit``."""
        return [self.ids.get(w, UNK) for w in words[:limit]]

    def build_dataset(self, split: str) -> list[dict[str, list[int]]]:
        data, n = examples(self.data, split), self.model_cfg.max_len
        if cut := sum(len(src) > n or len(tgt) >= n for src, tgt in data):
            self.report(f"{split}: {cut} pairs longer than model.max_len ({n}) are cut")
        return [{"src": self.encode(src, n), "tgt": self.encode(tgt, n - 1)} for src, tgt in data]

    def collate(self, samples: list[dict]) -> dict[str, Tensor]:
        """{"src": (B, Ts), "tgt_in": (B, Tt) BOS + target, "tgt_out": (B, Tt) target + EOS, -100 at PAD}."""
        return {"src": pad([s["src"] for s in samples], PAD),
                "tgt_in": pad([[BOS] + s["tgt"] for s in samples], PAD),
                "tgt_out": pad([s["tgt"] + [EOS] for s in samples], IGNORE)}

    def build_model(self) -> nn.Module:
        return EncoderDecoder(TransformerConfig.of(self.model_cfg), len(self.vocab), len(self.vocab), pad_id=PAD)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Teacher-forced cross-entropy summed over the target words, with their count."""
        logits = model(batch["src"], batch["tgt_in"])  # (B, Tt, V)
        loss, count = cross_entropy_sum(logits, batch["tgt_out"], ignore_index=IGNORE)
        return StepOutput(loss=loss, num_items=count, outputs={"logits": logits.detach()})

    def eval_step(self, model: nn.Module, batch: dict[str, Tensor], ctx: EvalContext) -> StepOutput:
        """The loss, plus greedy outputs (as long as the batch's longest target + EOS) for ExactMatch."""
        out = self.loss(model, batch)
        hyp = greedy_decode(model, batch["src"], max_len=batch["tgt_out"].shape[1], bos_id=BOS, eos_id=EOS, pad_id=PAD)
        out.outputs["hyp"] = hyp.tokens
        return out

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"acc": Accuracy(topk=(1,), target_key="tgt_out", ignore_index=IGNORE),  # val/top1
                "exact": ExactMatch()}  # val/exact_match

    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """``tk predict RUN "w3 w5 w7"``: a source (words split at spaces) -> {"output": the greedy output's words}."""
        out, device = [], next(model.parameters()).device
        for line in inputs:  # one source at a time: no padding, so a row never depends on its batch
            if not line.split():
                out.append({"error": f"{line!r}: an empty source"})
                continue
            src = torch.tensor([self.encode(line.split(), self.model_cfg.max_len)], device=device)
            hyp = greedy_decode(model, src, max_len=self.model_cfg.max_len, bos_id=BOS, eos_id=EOS, pad_id=PAD)
            ids = hyp.tokens[0].tolist()
            out.append({"output": " ".join(self.vocab[i] for i in ids[: ids.index(EOS) if EOS in ids else None])})
        return out

    def example_inputs(self, model: nn.Module) -> dict[str, Tensor]:
        """``tk export --format torch-export|onnx``: the teacher-forced forward (source, target so far) ->
        next-word logits at every target position, on two padded pairs; decoding loops over it outside."""
        return {"src": torch.tensor([[UNK, UNK, UNK], [UNK, PAD, PAD]]),
                "tgt": torch.tensor([[BOS, UNK, UNK, UNK], [BOS, UNK, PAD, PAD]])}
'''

RECIPE = '''\
# __NAME__ on generated pairs (seq2seq): reverse a sequence with a small encoder-decoder, about a minute on a CPU.
# Measured: val/exact_match 0.98 (val/top1 0.997) after 400 updates, 11 s on an idle 2-core CPU (seed 0).
#   tk run __RECIPE__
# Your data: tk run __RECIPE__ data.source=files data.train_file=train.tsv data.val_file=val.tsv
#   (`source<TAB>target` per line, words split at spaces)
task: __NAME__
data: {source: generated, num_train: 4000, num_val: 100, num_words: 13, max_len: 8, seed: 0}
model: {dim: 64, depth: 2, num_heads: 4, dropout: 0.0, max_len: 64}
optim: {name: adamw, lr: 3.0e-3, weight_decay: 0.01}
schedule: {name: warmup_cosine, warmup_steps: 20}
train: {max_steps: 400, batch_size: 32, eval_every: 200, best_metric: val/exact_match, seed: 0, log_every: 50}
output_dir: runs/__RECIPE__
'''

README_EXTRA = '''
## Data

`data.source: files` reads text files of `source<TAB>target` lines, each side's words split
at spaces (blank lines are skipped; a bad line is one error naming `file:line`):

```text
w3 w5 w7\tw7 w5 w3
a b\tb a
```

`tk predict runs/__RECIPE__ "w3 w5 w7"` decodes each source greedily: `{"output": "..."}`.
`tk export --format torch-export|onnx` writes the teacher-forced forward (source and the
target so far -> next-word logits); the decoding loop stays outside the graph.
'''

TEST_HEAD = '''\
from __PKG__.data import generate, read_tsv

INPUTS = ["w3 w5 w7", "w1 unseen"]  # raw inputs as a user types them: source sequences
BACKBONE = ""  # what model.pretrained_from copies: the whole model
'''

TEST_EXTRA = '''

def test_predict_decodes_words(run):
    rows = testing.check_predict(run, INPUTS)
    vocab = json.loads((run / "artifacts" / "vocab.json").read_text())
    assert all(set(r["output"].split()) <= set(vocab) for r in rows)


def test_target_is_the_reversed_source():
    assert all(tgt == src[::-1] for src, tgt in generate(__CLASS__.DataConfig(), 20, seed=1))


def test_exact_match_by_hand():
    from __PKG__.task import EOS, ExactMatch

    task = __CLASS__(load_config(str(RECIPE))[0])
    batch = task.collate([{"src": [4, 5], "tgt": [5, 4]}, {"src": [6], "tgt": [6]}])
    metric = ExactMatch()
    hyp = torch.tensor([[5, 4, EOS], [7, EOS, 0]])  # first right, second wrong
    metric.update(type("Out", (), {"outputs": {"hyp": hyp}})(), batch)
    assert metric.compute() == {"exact_match": 0.5}


def test_file_reader(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("w3 w5\\tw5 w3\\n\\na b c\\tc b a\\n")
    assert read_tsv(str(path)) == [(["w3", "w5"], ["w5", "w3"]), (["a", "b", "c"], ["c", "b", "a"])]
    path.write_text("w3 w5\\tw5 w3\\nw4 w6\\n")
    with pytest.raises(TkError, match=f"^{re.escape(str(path))}:2: expected 'source<TAB>target'"):
        read_tsv(str(path))
'''
