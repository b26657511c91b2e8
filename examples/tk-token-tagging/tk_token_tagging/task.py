"""The ``token_tagging`` task: BIO sequence labelling on the core TextEncoder.

Words -> tokens (a word-level vocabulary trained on the train split, or a BERT-family
folder's WordPiece tokenizer) -> :class:`tk.core.nn.text_encoder.TextEncoder` -> a linear
layer per token. Each word is tagged at its first token; the other tokens (and [CLS],
[SEP], PAD) get the label -100, which the per-token loss and the metrics skip.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import Tensor, nn
from torch.utils.data import Dataset

from tk.core import (
    Accuracy,
    EvalContext,
    Metric,
    OptimConfig,
    StepOutput,
    Task,
    TkError,
    TransformerConfig,
    cross_entropy_sum,
    param_groups,
)
from tk.core.exchange.hf.bert import bert_config, load_bert_weights, read_bert_config
from tk.core.nn.text_encoder import TextEncoder
from tk_token_tagging.corpus import TAGS, generate, read_conll
from tk_token_tagging.metrics import IGNORE, EntityF1
from tk_token_tagging.spans import bio_spans

TOKENIZER_FILE, TAGS_FILE, ENCODER_FILE = "tokenizer.json", "tags.json", "encoder.json"  # task files


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "conll"] = "synthetic"  # generated corpus, or CoNLL files (word TAG per line)
    num_train: int = 2000  # synthetic: training sentences
    num_val: int = 300  # synthetic: validation (and test) sentences
    seed: int = 0  # synthetic: corpus seed (val: seed + 1, test: seed + 2)
    train_file: str | None = None  # conll: the train split
    val_file: str | None = None  # conll: the val split
    test_file: str | None = None  # conll: the test split (tk eval --split test)
    max_len: int = 64  # tokens per sentence, specials included; longer sentences are cut

    def check(self, prefix: str = "data") -> list[str]:
        problems = []
        if self.source == "conll" and not (self.train_file and self.val_file):
            problems.append(f"{prefix}.train_file and {prefix}.val_file: both needed with {prefix}.source: conll")
        if self.max_len < 3:
            problems.append(f"{prefix}.max_len ({self.max_len}) must be >= 3")
        return problems


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's TransformerConfig (a from-scratch encoder; positions
    are learned, ``data.max_len`` of them) plus the head and fine-tuning keys."""

    dim: int = 64  # encoder width D
    depth: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    head_dropout: float = 0.1  # dropout before the tag layer
    pretrained_dir: str | None = None  # HF BERT-family folder to start from (its shape and tokenizer replace these)
    encoder_lr_scale: float = 1.0  # encoder lr = optim.lr * this (e.g. 0.1 when fine-tuning)


class TokenTagger(nn.Module):
    """TextEncoder -> dropout -> linear: (B, T) ids -> (B, T, num_tags) logits."""

    def __init__(self, encoder: TextEncoder, num_tags: int, head_dropout: float) -> None:
        super().__init__()
        self.encoder = encoder
        self.drop = nn.Dropout(head_dropout)
        self.head = nn.Linear(encoder.cfg.dim, num_tags)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.drop(self.encoder(input_ids)))


def word_tokenizer(sentences: Sequence[Sequence[str]]) -> Tokenizer:
    """A word-level tokenizer: ``[PAD]`` = 0, ``[UNK]`` = 1, then the words by frequency."""
    counts: dict[str, int] = {}
    for words in sentences:
        for w in words:
            counts[w] = counts.get(w, 0) + 1
    vocab = {"[PAD]": 0, "[UNK]": 1}
    for w in sorted(counts, key=lambda w: (-counts[w], w)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def pretrained_tokenizer(folder: str) -> Tokenizer:
    """A BERT folder's tokenizer: ``tokenizer.json``, else ``vocab.txt`` (lowercasing from
    ``tokenizer_config.json``'s ``do_lower_case``, default true)."""
    root = Path(folder).expanduser()
    if (root / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(root / "tokenizer.json"))
    if (root / "vocab.txt").is_file():
        cfg = root / "tokenizer_config.json"
        lower = json.loads(cfg.read_text()).get("do_lower_case", True) if cfg.is_file() else True
        tok = Tokenizer(models.WordPiece.from_file(str(root / "vocab.txt"), unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        specials = [(t, tok.token_to_id(t)) for t in ("[SEP]", "[CLS]")]
        if any(i is None for _, i in specials):
            raise TkError(f"model.pretrained_dir: {root / 'vocab.txt'} lacks [CLS] or [SEP]; is it a BERT vocabulary?")
        tok.post_processor = processors.BertProcessing(*specials)  # [CLS] words [SEP]
        return tok
    raise TkError(f"model.pretrained_dir: {root} has neither tokenizer.json nor vocab.txt")


class TokenTaggingTask(Task):
    """BIO sequence labelling (named entities) on the core text encoder, from scratch or a BERT folder."""

    name = "token_tagging"
    DataConfig = DataConfig
    ModelConfig = ModelConfig

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.tags: list[str] | None = None
        self.tokenizer: Tokenizer | None = None
        self.encoder_spec: dict[str, Any] | None = None

    # -- data and task files ----------------------------------------------------------
    def sentences(self, split: str) -> list[tuple[list[str], list[str]]]:
        """(words, tags) of ``split``: generated, or read from the split's CoNLL file."""
        d = self.data
        if d.source == "synthetic":
            offset = {"train": 0, "val": 1, "test": 2}[split]
            return generate(d.num_train if split == "train" else d.num_val, d.seed + offset)
        path = {"train": d.train_file, "val": d.val_file, "test": d.test_file}[split]
        if path is None:
            raise TkError(f"data.{split}_file: not set; give the {split} split's CoNLL file")
        return read_conll(path)

    def setup(self, resume: bool = False) -> None:
        """Fresh run: tag set and tokenizer from the train split (or the BERT folder), written
        as task files. Resume / eval / predict: read back, never rebuilt."""
        m = self.model_cfg
        if self.files.exists(TAGS_FILE):
            self.tags = json.loads(self.files.read_text(TAGS_FILE))
            self.tokenizer = Tokenizer.from_str(self.files.read_text(TOKENIZER_FILE))
            if self.files.exists(ENCODER_FILE):
                self.encoder_spec = json.loads(self.files.read_text(ENCODER_FILE))
            return
        train = self.sentences("train")
        seen = {t for _, tags in train for t in tags}
        self.tags = [t for t in TAGS if t in seen] + sorted(seen - set(TAGS))
        if m.pretrained_dir is not None:
            cfg, vocab, types = bert_config(read_bert_config(m.pretrained_dir), dropout=m.dropout)
            self.encoder_spec = {"cfg": dataclasses.asdict(cfg), "vocab_size": vocab, "type_vocab_size": types}
            self.tokenizer = pretrained_tokenizer(m.pretrained_dir)
        else:
            self.tokenizer = word_tokenizer([w for w, _ in train])
        if not resume and self.run_dir is not None:
            self.files.write_text(TAGS_FILE, json.dumps(self.tags))
            self.files.write_text(TOKENIZER_FILE, self.tokenizer.to_str())
            if self.encoder_spec is not None:
                self.files.write_text(ENCODER_FILE, json.dumps(self.encoder_spec))

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.token_to_id("[PAD]")
        if pad is None:
            raise TkError("the tokenizer has no [PAD] token; a BERT-style vocabulary needs one")
        return pad

    @property
    def max_len(self) -> int:
        if self.encoder_spec is not None:
            return min(self.data.max_len, self.encoder_spec["cfg"]["max_len"])
        return self.data.max_len

    def encode(self, words: Sequence[str], tags: Sequence[str] | None = None) -> dict[str, list[int]]:
        """Token ids, and (with ``tags``) each word's tag id at its first token, -100 elsewhere."""
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_len)
        enc = self.tokenizer.encode(list(words), is_pretokenized=True)
        item = {"input_ids": enc.ids, "first": []}
        labels, previous = [], None
        for position, word in enumerate(enc.word_ids):
            starts = word is not None and word != previous
            if starts:
                item["first"].append(position)
            labels.append(self.tag_id(tags[word]) if starts and tags is not None else IGNORE)
            previous = word
        if tags is not None:
            item["tags"] = labels
        return item

    def tag_id(self, tag: str) -> int:
        try:
            return self.tags.index(tag)
        except ValueError:
            raise TkError(f"tag {tag!r} is not among the train split's tags {self.tags}; fix the data") from None

    def build_dataset(self, split: str) -> Dataset:
        return [self.encode(words, tags) for words, tags in self.sentences(split)]

    def collate(self, samples: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        """{"input_ids": (B, T) PAD-padded, "tags": (B, T) with -100 where no word starts}."""
        def pad(key: str, value: int) -> Tensor:
            return nn.utils.rnn.pad_sequence([torch.tensor(s[key]) for s in samples], batch_first=True,
                                             padding_value=value)

        batch = {"input_ids": pad("input_ids", self.pad_id)}
        return {**batch, "tags": pad("tags", IGNORE)} if "tags" in samples[0] else batch

    # -- model, loss, metrics -----------------------------------------------------------
    def build_model(self) -> nn.Module:
        m = self.model_cfg
        if self.encoder_spec is not None:
            cfg = TransformerConfig(**self.encoder_spec["cfg"])
            vocab, types = self.encoder_spec["vocab_size"], self.encoder_spec["type_vocab_size"]
        else:
            cfg = TransformerConfig.of(m, max_len=self.data.max_len, pos_encoding="learned")
            vocab, types = self.tokenizer.get_vocab_size(), 0
        return TokenTagger(TextEncoder(cfg, vocab, type_vocab_size=types, pad_id=self.pad_id), len(self.tags),
                           m.head_dropout)

    def init_pretrained(self, model: nn.Module) -> None:
        """Start from ``model.pretrained_dir``'s encoder weights (fresh runs only; the head is new)."""
        if self.model_cfg.pretrained_dir is not None:
            load_bert_weights(model.encoder, self.model_cfg.pretrained_dir)

    def param_groups(self, model: nn.Module, optim_cfg: OptimConfig) -> list[dict[str, Any]]:
        scale = self.model_cfg.encoder_lr_scale
        return param_groups(model, optim_cfg, lr_scale=lambda n: scale if n.startswith("encoder.") else 1.0)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Per-token cross-entropy summed over the words' first tokens, with their count."""
        logits = model(batch["input_ids"])  # (B, T, num_tags)
        loss, count = cross_entropy_sum(logits, batch["tags"], ignore_index=IGNORE)
        return StepOutput(loss=loss, num_items=count, outputs=logits.detach())

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"entities": EntityF1(self.tags),  # val/entity_f1, val/entity_precision, val/entity_recall
                "tags": Accuracy(topk=(1,), target_key="tags", ignore_index=IGNORE)}  # val/top1

    # -- inference ----------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """Tags and entities of each whitespace-tokenised sentence.

        Returns:
            One dict per input: ``{"tags": [...], "entities": [{"type", "start", "end", "text"}]}``
            (``end`` exclusive, in words); words cut by ``data.max_len`` are tagged ``O``.
        """
        out: list[dict[str, Any]] = []
        device = next(model.parameters()).device
        for line in inputs:
            words = line.split()
            if not words:
                out.append({"error": f"{line!r}: an empty sentence"})
                continue
            item = self.encode(words)
            logits = model(torch.tensor([item["input_ids"]], device=device))[0]
            tags = [self.tags[int(logits[p].argmax())] for p in item["first"]]
            tags += ["O"] * (len(words) - len(tags))
            entities = [{"type": t, "start": s, "end": e, "text": " ".join(words[s:e])} for t, s, e in bio_spans(tags)]
            out.append({"tags": tags, "entities": entities})
        return out
