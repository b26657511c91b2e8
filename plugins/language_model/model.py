"""The ``model:`` section and the GPT: core's ``DecoderOnlyLM`` with GPT-2's initialisation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from tk.core.nn.config import ENCODER_DECODER_KEYS, TransformerConfig
from tk.core.nn.transformer import DecoderOnlyLM


@dataclass
class ModelConfig(TransformerConfig):
    """The ``model:`` section: TransformerConfig with GPT defaults."""

    unused_keys: ClassVar[tuple[str, ...]] = ENCODER_DECODER_KEYS  # one stack: no encoder-decoder keys

    dim: int = 128  # model width D
    dropout: float = 0.0  # residual/embedding dropout
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "learned"  # position information
    max_len: int = 1024  # positions of the learned table: block_size for training, prompt + new tokens in generation
    pretrained_from: str | None = None  # a language_model run dir or .pt checkpoint, or a Hugging Face decoder folder / hub id (GPT-2, Llama, Qwen, Mistral, Gemma, Phi-3): its shape and tokenizer come with it
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # weights of a Hugging Face source: float32 master weights (full fine-tuning); bfloat16/auto keep a half-precision file as it is (generation, eval, LoRA)


def gpt2_init(model: DecoderOnlyLM, depth: int) -> None:
    """GPT-2's extra step over DecoderOnlyLM's N(0, 0.02): residual output projections get
    std 0.02 / sqrt(2 * layers), so the residual stream's variance does not grow with depth."""
    for name, p in model.named_parameters():
        if name.endswith(("self_attn.proj.weight", "mlp.fc2.weight")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth))


def build_model(cfg: ModelConfig, vocab_size: int) -> DecoderOnlyLM:
    """A GPT over ``vocab_size`` token ids, GPT-2 initialised."""
    model = DecoderOnlyLM(cfg, vocab_size)
    gpt2_init(model, cfg.depth)
    return model
