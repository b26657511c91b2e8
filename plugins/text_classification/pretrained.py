"""Where a fine-tuning text classifier's encoder comes from (``model.pretrained_from``): a tk
run whose model keeps a core ``TextEncoder`` (its shape keys, tokenizer and weights), or an
HF BERT folder (its ``config.json`` gives the shape, so recipe shape keys are ignored)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tk.core.engine.inference import TRANSFORMER_SHAPE_KEYS, SourceRun, adopt_shape
from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig
from tk.core.text import TextTokenizer
from tk.plugins.text_classification.model import ModelConfig

__all__ = ["SOURCE_TASKS", "ENCODER_PREFIX", "SHAPE_KEYS", "TOKENIZER_FILE", "tokenizer_and_spec",
           "source_encoder_spec", "ignored_arch_keys"]

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"  # task file: the tokenizer (trained, or the pretrained model's)
SOURCE_TASKS = ("text_classification", "mlm")  # runs whose model keeps a core TextEncoder under ENCODER_PREFIX
ENCODER_PREFIX = "encoder."
# model.* keys a source run's config.yaml sets (the positions come from its table, or data.max_len)
SHAPE_KEYS = tuple(k for k in TRANSFORMER_SHAPE_KEYS if k not in ("max_len", "tie_embeddings", "share_embeddings"))
# model.* keys that shape a from-scratch encoder; a pretrained checkpoint's config.json sets them
# (model.dropout is the exception: it overrides the checkpoint's dropout)
_ARCH_KEYS = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name != "dropout")


def ignored_arch_keys(m: ModelConfig) -> list[str]:
    """``model.*`` architecture keys set away from their defaults, which an HF ``model.pretrained_from`` overrides."""
    default = ModelConfig()
    return [k for k in _ARCH_KEYS if getattr(m, k) != getattr(default, k)]


def tokenizer_and_spec(model_cfg: ModelConfig, source: SourceRun, max_len: int) -> tuple[TextTokenizer, dict[str, Any]]:
    """The tokenizer and the encoder spec of a source run (checked against each other)."""
    spec = source_encoder_spec(model_cfg, source, max_len)
    tokenizer = TextTokenizer.from_str(source.read_file(TOKENIZER_FILE))
    if tokenizer.vocab_size != spec["vocab_size"]:
        raise TkError(f"model.pretrained_from: {source.spec}'s {TOKENIZER_FILE} has {tokenizer.vocab_size} tokens "
                      f"but its embedding {spec['vocab_size']} rows; give the run dir the checkpoint belongs to")
    return tokenizer, spec


def source_encoder_spec(model_cfg: ModelConfig, source: SourceRun, max_len: int) -> dict[str, Any]:
    """The encoder of a source run: its config's shape keys (a recipe value that disagrees is an
    error), its position table's length (else ``max_len``, the run's data.max_len), its
    embeddings' vocabulary sizes."""
    m = adopt_shape(model_cfg, source.section("model"), SHAPE_KEYS)
    weights = source.weights()
    tok = weights.get(f"{ENCODER_PREFIX}tok_embed.weight")
    if tok is None:
        raise TkError(f"model.pretrained_from: {source.spec} has no tensor {ENCODER_PREFIX}tok_embed.weight: its "
                      f"model keeps no core TextEncoder under {ENCODER_PREFIX!r}")
    pos, types = weights.get(f"{ENCODER_PREFIX}pos_embed.weight"), weights.get(f"{ENCODER_PREFIX}type_embed.weight")
    cfg = TransformerConfig.of(m, max_len=pos.shape[0] if pos is not None else max_len)
    log.debug("model.pretrained_from: the encoder of %s (%s run, %s): dim %d, depth %d",
              source.spec, source.task, source.checkpoint.name, cfg.dim, cfg.depth)
    return {"cfg": dataclasses.asdict(cfg), "vocab_size": int(tok.shape[0]),
            "type_vocab_size": int(types.shape[0]) if types is not None else 0}
