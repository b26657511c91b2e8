"""The ``model:`` section and the masked language model: core :class:`TextEncoder` plus BERT's
MLM head (dense, GELU, LayerNorm, decoder tied to the token embeddings, bias).

BERT: https://arxiv.org/abs/1810.04805 (the head: ``BertLMPredictionHead`` of the reference code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.nn.config import ENCODER_DECODER_KEYS, TransformerConfig
from tk.core.nn.text_encoder import TextEncoder


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section: core's :class:`TransformerConfig` (``data.max_len``
    positions), with text_classification's defaults so a pretrained encoder fits a classifier."""

    unused_keys: ClassVar[tuple[str, ...]] = ENCODER_DECODER_KEYS  # one stack: no encoder-decoder keys

    dim: int = 128  # encoder width D
    depth: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 2.0  # feed-forward width / dim
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = (
        "learned")  # learned: BERT's trained table; sinusoidal: the fixed sin/cos table; rotary: relative; none
    pretrained_from: str | None = None  # an mlm or text_classification run dir or .pt checkpoint: its encoder and tokenizer (continued pre-training)


class MLMHead(nn.Module):
    """States (N, D) -> dense -> GELU -> LayerNorm -> decoder (tied to the token embedding) + bias -> (N, V).

    Args:
        embedding: the encoder's token embedding (V, D); the decoder's weight *is* its weight.
        norm_eps: the LayerNorm's epsilon.
    """

    def __init__(self, embedding: nn.Embedding, norm_eps: float) -> None:
        super().__init__()
        vocab, dim = embedding.weight.shape
        self.dense = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.decoder = nn.Linear(dim, vocab, bias=False)
        self.decoder.weight = embedding.weight  # tied: one parameter, one storage
        self.bias = nn.Parameter(torch.zeros(vocab))
        nn.init.normal_(self.dense.weight, std=0.02)
        nn.init.zeros_(self.dense.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(hidden)))) + self.bias


class MaskedLM(nn.Module):
    """:class:`TextEncoder` (``encoder.*``, the same names as text_classification's
    ``TextClassifier.encoder``) + :class:`MLMHead` (``head.*``).

    Args:
        encoder: the text encoder.
    """

    def __init__(self, encoder: TextEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = MLMHead(encoder.tok_embed, encoder.cfg.norm_eps)

    def num_layers(self) -> int:
        """Layer ids for ``optim.layer_decay`` (see :meth:`TextEncoder.num_layers`); the head is the last."""
        return self.encoder.num_layers()

    def layer_id(self, name: str) -> int:
        """Layer id of a parameter name (the head: :meth:`num_layers`)."""
        if name.startswith("encoder."):
            return self.encoder.layer_id(name[len("encoder."):])
        return self.num_layers()

    def forward(self, input_ids: Tensor, token_types: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Args:
            input_ids: (B, T) long, PAD = the encoder's ``pad_id``.
            token_types: (B, T) segment ids (default zeros).
            positions: (B, T) bool, the positions to predict; None = all.

        Returns:
            (N, V) logits of the N True ``positions`` in row-major order (the states are
            gathered before the vocabulary projection), or (B, T, V) without ``positions``.
        """
        hidden = self.encoder(input_ids, token_types, key_padding_mask=self.encoder.padding_mask(input_ids))
        return self.head(hidden if positions is None else hidden[positions])
