"""The ``model:`` section: core's Transformer encoder-decoder (``tk.core.nn.transformer.EncoderDecoder``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tk.core.nn.config import TransformerConfig


@dataclass
class ModelConfig(TransformerConfig):
    """The recipe's ``model:`` section (TransformerConfig's keys)."""

    dim: int = 256  # model width D
    depth: int = 3  # encoder and decoder layers (unless encoder_depth/decoder_depth)
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 4.0  # feed-forward width / dim
    dropout: float = 0.1  # residual/embedding dropout
    max_len: int = 256  # positions (tokens) per sequence
    tie_embeddings: bool = True  # output projection = target embedding
    share_embeddings: bool = True  # one embedding for source and target (needs tokenizer.joint)
    pretrained_from: str | None = None  # a Hugging Face translator (Marian/opus-mt or NLLB save_pretrained folder, or hub id): its shape, weights, tokenizers and decoding settings; null = train from scratch
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # weights of a pretrained translator: float32 master weights (fine-tuning); bfloat16/auto keep a half-precision file as it is (translation, eval, LoRA)

