"""A BERT-style text encoder: token + position (+ token-type) embeddings, an
embedding LayerNorm, the core :class:`TransformerEncoder`, and cls / mean / max pooling.

BERT: "Pre-training of Deep Bidirectional Transformers for Language Understanding"
(Devlin et al., 2018), https://arxiv.org/abs/1810.04805. Pretrained BERT-family weights
load through :func:`tk.core.exchange.hf.bert.load_bert`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from tk.core.nn.config import TransformerConfig
from tk.core.nn.layers import build_norm
from tk.core.nn.masks import padding_mask
from tk.core.nn.packing import segment_attention_mask, segment_positions
from tk.core.nn.pos_embed import LearnedPositionalEmbedding, build_positions
from tk.core.nn.transformer import TransformerEncoder

__all__ = ["TextEncoder", "pool"]

TEXT_POOLINGS = ("cls", "mean", "max")


def pool(hidden: Tensor, key_padding_mask: Tensor | None, how: Literal["cls", "mean", "max"]) -> Tensor:
    """One vector per sequence.

    Args:
        hidden: (B, T, D) token states.
        key_padding_mask: (B, T) bool, True at padding (None: no padding).
        how: "cls" (the first token), "mean" or "max" over non-PAD tokens.

    Returns:
        (B, D).
    """
    if how == "cls":
        return hidden[:, 0]
    if key_padding_mask is None:
        return hidden.mean(1) if how == "mean" else hidden.amax(1)
    keep = (~key_padding_mask).unsqueeze(-1)  # (B, T, 1)
    if how == "mean":
        return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1)
    if how == "max":
        return hidden.masked_fill(~keep, torch.finfo(hidden.dtype).min).amax(1)
    raise ValueError(f"pooling ({how!r}) must be one of {', '.join(TEXT_POOLINGS)}")


class TextEncoder(nn.Module):
    """Token ids -> contextual states, BERT layout (embeddings summed, then norm and dropout).

    Positions follow ``cfg.pos_encoding``: ``"learned"`` (``cfg.max_len`` trained vectors, BERT),
    ``"sinusoidal"`` (the fixed sin/cos table, no parameter), ``"rotary"`` (the encoder's
    attention rotates queries and keys: relative positions, no ``pos_embed``) or ``"none"``
    (no position information). Parameter names: ``tok_embed``, ``pos_embed`` (learned only),
    ``type_embed`` (absent with ``type_vocab_size=0``), ``embed_norm``, ``encoder.*``.

    Args:
        cfg: the encoder layers' options (BERT: ``norm_first=False``, ``activation="gelu"``,
            ``norm_eps=1e-12``).
        vocab_size: token ids are in ``[0, vocab_size)``.
        type_vocab_size: token-type (segment) ids; 0 = no token-type embedding.
        pad_id: the padding id (its mask is derived from it when none is given).
    """

    def __init__(self, cfg: TransformerConfig, vocab_size: int, type_vocab_size: int = 2, pad_id: int = 0) -> None:
        super().__init__()
        cfg.validate()
        self.cfg, self.pad_id = cfg, pad_id
        self.tok_embed = nn.Embedding(vocab_size, cfg.dim, padding_idx=pad_id)
        self.pos_embed = build_positions(cfg)
        self.type_embed = nn.Embedding(type_vocab_size, cfg.dim) if type_vocab_size > 0 else None
        self.embed_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_bias)
        self.embed_drop = nn.Dropout(cfg.dropout)
        self.encoder = TransformerEncoder(cfg)
        learned_pos = self.pos_embed if isinstance(self.pos_embed, LearnedPositionalEmbedding) else None
        for module in (self.tok_embed, learned_pos, self.type_embed):
            if module is not None:
                nn.init.normal_(module.weight, std=0.02)
        with torch.no_grad():
            self.tok_embed.weight[pad_id].zero_()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of every encoder layer in training (see
        :class:`~tk.core.nn.stack.TransformerStack`)."""
        self.encoder.set_grad_checkpointing(enable)

    def num_layers(self) -> int:
        """Layers for ``optim.layer_decay``: embeddings 0, encoder layer i -> i + 1."""
        return self.encoder.num_layers()

    def layer_id(self, name: str) -> int:
        """Layer id of a parameter name (``optim.layer_decay``)."""
        if name.startswith("encoder."):
            return self.encoder.layer_id(name[len("encoder."):])
        return 0

    def padding_mask(self, tokens: Tensor) -> Tensor:
        """(B, T) bool, True where ``tokens == pad_id``."""
        return padding_mask(tokens, self.pad_id)

    def forward(self, tokens: Tensor, token_types: Tensor | None = None,
                key_padding_mask: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
        """Args:
            tokens: (B, T) long ids, T <= ``cfg.max_len``.
            token_types: (B, T) long segment ids (default zeros).
            key_padding_mask: (B, T) bool, True at padding; default from ``pad_id``.
            segments: a packed batch (:mod:`tk.core.nn.packing`): (B, T) long, each token's
                sequence in its row (0 at padding); attention stays within each sequence and
                learned/sinusoidal positions restart at each.

        Returns:
            (B, T, D) hidden states (padded positions hold values that mean nothing).

        Raises:
            ValueError: a sequence longer than ``cfg.max_len``.
        """
        T = tokens.shape[1]
        if T > self.cfg.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len {self.cfg.max_len}; truncate the input")
        attn_mask = positions = None
        if segments is not None:  # the mask keeps padding out (a padded query sees only itself)
            attn_mask, positions, key_padding_mask = segment_attention_mask(segments), segment_positions(segments), None
        elif key_padding_mask is None:
            key_padding_mask = self.padding_mask(tokens)
        x = self.tok_embed(tokens)
        if self.pos_embed is not None:
            x = self.pos_embed(x, positions=positions)  # (B, T, D) + positions 0 .. T - 1 (per sequence)
        if self.type_embed is not None:
            types = torch.zeros_like(tokens) if token_types is None else token_types
            x = x + self.type_embed(types)
        x = self.embed_drop(self.embed_norm(x))
        return self.encoder(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
