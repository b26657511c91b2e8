"""The ``mlm`` task: BERT's masked-language-model pretraining of the core TextEncoder."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.core.exchange.backbone import PretrainedBackbone
from tk.core.exchange.pretrained import TRANSFORMER_SHAPE_KEYS
from tk.core.losses import cross_entropy_sum
from tk.core.metrics import Metric
from tk.core.nn.config import TransformerConfig
from tk.core.nn.text_encoder import TextEncoder
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.core.text import BERT_SPECIALS, BERT_TEMPLATE, TextTokenizer, build_tokenizer
from tk.core.text.token_store import TokenStore
from tk.plugins.mlm.data import (
    IGNORE,
    MASK,
    DataConfig,
    MLMTokenizerConfig,
    PackedTokens,
    SequenceDataset,
    TextRange,
    check_data,
    corpus_identity,
    make_sequences,
    mask_tokens,
    pad_batch,
    read_texts,
    stream_texts,
)
from tk.plugins.mlm.fill import PredictConfig, fill_masks
from tk.plugins.mlm.metrics import MaskedLMMetrics
from tk.plugins.mlm.model import MaskedLM, ModelConfig

log = logging.getLogger(__name__)

SPECIALS = (*BERT_SPECIALS, MASK)  # [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4 in a trained tokenizer
TOKENIZER_FILE = "tokenizer.json"  # task file: the tokenizer (text_classification's format: tokenizer.path can load it)
ENCODER_FILE = "encoder.json"  # task file: the encoder's shape {"cfg", "vocab_size", "type_vocab_size"}
TYPE_VOCAB = 2  # token-type embeddings, as text_classification's encoder (so its state dict loads there)
_VAL_CHUNK = 1024  # val sequences masked per call (the masks are drawn once, from data.seed)


class MLMTask(Task):
    """Masked-LM pretraining (BERT) of the core TextEncoder on text files, a datasets corpus or synthetic text."""

    name: ClassVar[str] = "mlm"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"tokenizer": MLMTokenizerConfig, "predict": PredictConfig}
    # model.pretrained_from: continued pre-training from an mlm run, or from a text_classification run's encoder
    # (its tokenizer comes with it; positions follow data.max_len, so max_len is not taken from the source)
    pretrained_backbone: ClassVar[PretrainedBackbone] = PretrainedBackbone(
        prefix="encoder.", accepts=("text_classification",), files=(TOKENIZER_FILE,),
        shape_keys=tuple(k for k in TRANSFORMER_SHAPE_KEYS if k != "max_len"))

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.tok_cfg: MLMTokenizerConfig = self.sections.get("tokenizer") or MLMTokenizerConfig()
        self.predict_cfg: PredictConfig = self.sections.get("predict") or PredictConfig()
        self.tokenizer: TextTokenizer | None = None
        self._texts: dict[str, list[str]] | None = None
        self._special: torch.Tensor | None = None  # ids never masked
        self._candidates: torch.Tensor | None = None  # ids a random replacement is drawn from

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        d: DataConfig = cfg.sections["data"]
        tok: MLMTokenizerConfig = cfg.sections.get("tokenizer") or MLMTokenizerConfig()
        problems = check_data(d)
        if tok.path is None and tok.vocab_size < 16:
            problems.append(f"tokenizer.vocab_size ({tok.vocab_size}) must be >= 16 (5 specials + the text's tokens)")
        return problems

    # -- state -----------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Fresh run: the tokenizer trained on the train texts (or ``tokenizer.path``), written
        with the encoder's shape as task files. Resume/eval/predict: read back, never retrained."""
        if self.files.exists(TOKENIZER_FILE):
            self.tokenizer = TextTokenizer.from_str(self.files.read_text(TOKENIZER_FILE))
        else:
            texts = (t for t in self.texts["train"])  # not read when tokenizer.path is set
            self.tokenizer = build_tokenizer(self.tok_cfg, texts, SPECIALS, BERT_TEMPLATE)
        specials = sorted({self.tokenizer.token_id(s) for s in SPECIALS} | set(self.tokenizer.special_ids.values()))
        self._special = torch.tensor(specials)
        every = torch.arange(self.tokenizer.vocab_size)
        self._candidates = every[~torch.isin(every, self._special)]
        if len(self._candidates) < 2:
            raise TkError(f"tokenizer: the vocabulary has {len(self._candidates)} token(s) besides the specials "
                          f"{list(SPECIALS)}; raise tokenizer.vocab_size or give a longer corpus")
        if not resume and self.run_dir is not None:
            if not self.files.exists(TOKENIZER_FILE):
                self.files.write_text(TOKENIZER_FILE, self.tokenizer.to_str())
            if not self.files.exists(ENCODER_FILE):
                spec = {"cfg": dataclasses.asdict(self.encoder_config()), "vocab_size": self.tokenizer.vocab_size,
                        "type_vocab_size": TYPE_VOCAB}
                self.files.write_text(ENCODER_FILE, json.dumps(spec))

    @property
    def texts(self) -> dict[str, list[str]]:
        """The train and val texts (read once, on first use)."""
        if self._texts is None:
            self._texts = stream_texts(self.data) if self.data.streaming else read_texts(self.data)
        return self._texts

    @property
    def pad_id(self) -> int:
        return self.tokenizer.token_id("[PAD]")

    def encoder_config(self) -> TransformerConfig:
        """The encoder's shape: the ``model:`` section with ``data.max_len`` positions."""
        return TransformerConfig.of(self.model_cfg, max_len=self.data.max_len)

    # -- data ------------------------------------------------------------------------
    def build_dataset(self, split: str) -> Dataset:
        """``[CLS] ... [SEP]`` sequences of ``split`` (test: the val texts). Train sequences are
        masked afresh in every batch; val ones once, from ``data.seed``, so every evaluation
        scores the same masked tokens."""
        texts = self.texts["train" if split == "train" else "val"]
        d = self.data
        if split == "train" and d.pack and d.token_cache and d.source != "synthetic":
            store = TokenStore(self.tokenizer, corpus_identity(d), "", np.int32, add_special_tokens=False)
            batches = texts.batches() if isinstance(texts, TextRange) else \
                (texts[i: i + 1000] for i in range(0, len(texts), 1000))
            tokens, _, _ = store.build(batches)
            return PackedTokens(tokens, d.max_len, self.tokenizer.token_id("[CLS]"), self.tokenizer.token_id("[SEP]"))
        seqs, cut = make_sequences(self.tokenizer, texts, self.data.max_len, self.data.pack)
        if not seqs:
            raise TkError(f"data: the {split} split has no token after tokenisation; give a longer corpus")
        if cut:
            log.warning("%s split: %d of %d texts truncated to %d tokens (data.max_len; data.pack=true keeps "
                        "every token)", split, cut, len(texts), self.data.max_len)
        if split == "train":
            return SequenceDataset([{"input_ids": s} for s in seqs])
        g = torch.Generator().manual_seed(self.data.seed)
        items = []
        for start in range(0, len(seqs), _VAL_CHUNK):
            chunk = seqs[start: start + _VAL_CHUNK]
            inputs, labels = self.mask(pad_batch(chunk, self.pad_id), g)
            items += [{"input_ids": i[: len(s)].tolist(), "labels": y[: len(s)].tolist()}
                      for s, i, y in zip(chunk, inputs, labels)]
        return SequenceDataset(items)

    def mask(self, ids: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`mask_tokens` of a (B, T) batch with this run's specials, ``[MASK]`` and ``data.mask_prob``."""
        special = torch.isin(ids, self._special)
        return mask_tokens(ids, special, self.tokenizer.token_id(MASK), self._candidates, self.data.mask_prob,
                           generator)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """``{"input_ids": (B, T) masked ids, "labels": (B, T) original id at masked positions,
        -100 elsewhere}``, padded to the longest sequence. Training masks here with torch's
        global generator: the engine seeds it per batch in loader workers and checkpoints it
        in the main process, so a resumed run draws the same masks."""
        ids = pad_batch([s["input_ids"] for s in samples], self.pad_id)
        if "labels" in samples[0]:  # val: masked once in build_dataset
            labels = torch.full_like(ids, IGNORE)
            for row, s in enumerate(samples):
                labels[row, : len(s["labels"])] = torch.tensor(s["labels"])
            return {"input_ids": ids, "labels": labels}
        inputs, labels = self.mask(ids)
        return {"input_ids": inputs, "labels": labels}

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        encoder = TextEncoder(self.encoder_config(), self.tokenizer.vocab_size, type_vocab_size=TYPE_VOCAB,
                              pad_id=self.pad_id)
        return MaskedLM(encoder)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Cross-entropy summed over the masked tokens (``num_items``: their count); the logits
        are computed at those positions only. ``outputs``: ``(logits (N, V), targets (N,))``."""
        labels = batch["labels"]
        positions = labels.ne(IGNORE)
        logits = model(batch["input_ids"], None, positions)  # (N, V)
        targets = labels[positions]
        loss, count = cross_entropy_sum(logits, targets)
        return StepOutput(loss=loss, num_items=count, outputs=(logits.detach(), targets))

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"mlm": MaskedLMMetrics()}

    # -- inference ---------------------------------------------------------------------
    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """Per text: ``{"filled": text, "masks": [{"tokens": [...], "probs": [...]}, ...]}``, the
        ``predict.top_k`` most likely tokens of each ``[MASK]``; ``{"error": ...}`` without one."""
        model.eval()
        return [fill_masks(model, self.tokenizer, t, self.data.max_len, self.predict_cfg.top_k) for t in inputs]
