"""The ``model:`` section and the classifier: core :class:`TextEncoder`, pooling, dropout, linear head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from tk.core.nn.config import ENCODER_DECODER_KEYS, TransformerConfig
from tk.core.nn.packing import pool_segments
from tk.core.nn.text_encoder import TEXT_POOLINGS, TextEncoder, pool


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's :class:`TransformerConfig` (a from-scratch
    encoder; ``data.max_len`` positions) plus the head and fine-tuning keys."""

    unused_keys: ClassVar[tuple[str, ...]] = ENCODER_DECODER_KEYS  # one stack: no encoder-decoder keys

    dim: int = 128  # encoder width D
    depth: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = (
        "learned")  # learned: BERT's trained table; sinusoidal: the fixed sin/cos table; rotary: relative; none
    pooling: Literal["cls", "mean", "max"] = "cls"  # sentence vector: [CLS] state, or mean/max over non-PAD
    pooler: bool | None = None  # BERT's pooler (dense + tanh on [CLS]) before the head; null: on for an HF BERT source and a post-norm (BERT-shaped) [CLS] encoder, where transformers users expect it
    head_dropout: float = 0.1  # dropout before the classification layer
    pretrained_from: str | None = None  # start from: a text_classification/mlm run dir or .pt checkpoint, or an HF BERT folder / hub id (its shape and tokenizer replace these)
    encoder_lr_scale: float = 1.0  # encoder lr = optim.lr * this (e.g. 0.1 when fine-tuning); head: optim.lr
    threshold: float = 0.5  # data.multi_label: a label is predicted when its sigmoid probability exceeds this

    def check(self, prefix: str = "model") -> list[str]:
        problems = super().check(prefix)
        if self.pooling not in TEXT_POOLINGS:
            problems.append(f"{prefix}.pooling ({self.pooling!r}) must be one of {', '.join(TEXT_POOLINGS)}")
        if self.pooler and self.pooling != "cls":
            problems.append(f"{prefix}.pooler: BERT's pooler reads the [CLS] state; set {prefix}.pooling=cls or "
                            f"{prefix}.pooler=false")
        if not 0.0 <= self.head_dropout < 1.0:
            problems.append(f"{prefix}.head_dropout ({self.head_dropout}) must be in [0, 1)")
        if not self.encoder_lr_scale > 0:
            problems.append(f"{prefix}.encoder_lr_scale ({self.encoder_lr_scale}) must be > 0")
        if not 0.0 < self.threshold < 1.0:
            problems.append(f"{prefix}.threshold ({self.threshold}) must be in (0, 1)")
        return problems


def uses_pooler(m: ModelConfig, encoder: dict[str, Any] | None = None) -> bool:
    """``model.pooler``, or where it is null: on for a post-norm [CLS] encoder, BERT's shape (an
    HF BERT source's ``encoder`` spec is post-norm too), where transformers users expect it."""
    if m.pooler is not None:
        return m.pooler
    norm_first = encoder["norm_first"] if encoder is not None else m.norm_first
    return m.pooling == "cls" and not norm_first


@dataclass
class PredictConfig:
    """The ``predict:`` section (``tk predict`` only, e.g. ``predict.truncate=true``)."""

    truncate: bool = False  # a text longer than data.max_len: classify its first tokens (else an error for that text)


class TextClassifier(nn.Module):
    """Encoder -> pooled vector (B, D) [-> BERT's pooler: tanh(dense)] -> dropout -> linear ->
    logits (B, C).

    Args:
        encoder: a :class:`TextEncoder`.
        num_classes: C.
        pooling: "cls", "mean" or "max".
        head_dropout: dropout before the linear layer.
        pooler: BERT's pooler (``BertPooler``: dense D -> D, tanh) on the pooled [CLS] state.
    """

    def __init__(self, encoder: TextEncoder, num_classes: int, pooling: str, head_dropout: float,
                 pooler: bool = False) -> None:
        super().__init__()
        self.encoder, self.pooling = encoder, pooling
        self.pooler = nn.Linear(encoder.cfg.dim, encoder.cfg.dim) if pooler else None
        self.drop = nn.Dropout(head_dropout)
        self.head = nn.Linear(encoder.cfg.dim, num_classes)
        for layer in (self.pooler, self.head):  # BERT's initialisation
            if layer is not None:
                nn.init.normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)

    def num_layers(self) -> int:
        """Layer ids for ``optim.layer_decay``: embeddings 0, encoder layer i -> i + 1, the
        encoder's final norm (pre-norm only), the pooler and the head (full lr) -> ``num_layers()`` = depth + 1."""
        return self.encoder.num_layers()

    def layer_id(self, name: str) -> int:
        """Layer id of a parameter name (see :meth:`num_layers`)."""
        if name.startswith("encoder."):
            return self.encoder.layer_id(name[len("encoder."):])
        return self.num_layers()

    def forward(self, input_ids: Tensor, token_types: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
        """Args: input_ids (B, T) long, PAD = the encoder's ``pad_id``; token_types (B, T);
        segments: a packed batch's (R, T) sequence ids (:mod:`tk.core.nn.packing`).
        Returns: (B, C) logits, or (N, C) for the N sequences of a packed batch."""
        if segments is not None:
            pooled = pool_segments(self.encoder(input_ids, token_types, segments=segments), segments, self.pooling)
        else:
            mask = self.encoder.padding_mask(input_ids)
            pooled = pool(self.encoder(input_ids, token_types, key_padding_mask=mask), mask, self.pooling)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        return self.head(self.drop(pooled))
