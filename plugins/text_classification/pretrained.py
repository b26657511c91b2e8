"""Where a fine-tuning text classifier's encoder comes from (``model.pretrained_from``): a tk
run whose model keeps a core ``TextEncoder`` (its shape keys, tokenizer and weights), or an
HF BERT folder (its ``config.json`` gives the shape, so recipe shape keys are ignored)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import Any

from tk.core.engine.inference import TRANSFORMER_SHAPE_KEYS, SourceRun, adopt_shape
from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig
from tk.core.text import TextTokenizer
from tk.plugins.text_classification.model import ModelConfig

__all__ = ["SOURCE_TASKS", "ENCODER_PREFIX", "SHAPE_KEYS", "TOKENIZER_FILE", "tokenizer_and_spec",
           "source_encoder_spec", "hf_shape_problems"]

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"  # task file: the tokenizer (trained, or the pretrained model's)
SOURCE_TASKS = ("text_classification", "mlm")  # runs whose model keeps a core TextEncoder under ENCODER_PREFIX
ENCODER_PREFIX = "encoder."
# model.* keys a source run's config.yaml sets (the positions come from its table, or data.max_len)
SHAPE_KEYS = tuple(k for k in TRANSFORMER_SHAPE_KEYS if k not in ("max_len", "tie_embeddings", "share_embeddings"))
def hf_shape_problems(m: ModelConfig, built: TransformerConfig, given: Collection[str] | None
                      ) -> tuple[list[str], list[str]]:
    """The shape keys of the recipe that an HF checkpoint's ``config.json`` contradicts (the
    feed-forward width compared as ``mlp_ratio`` x ``dim`` or ``hidden_dim``): ``(problems,
    ignored)``. A key typed as an override (``given``) is a problem, one line for all of
    them; a key the recipe file sets away from its default is ignored (config.json wins)."""
    default = ModelConfig()
    typed = {k for k in SHAPE_KEYS if given is not None and f"model.{k}" in given}
    written = [k for k in SHAPE_KEYS if k in typed or getattr(m, k) != getattr(default, k)]
    wrong = [(k, getattr(m, k), getattr(built, k)) for k in written if k not in ("mlp_ratio", "hidden_dim")
             and getattr(m, k) != getattr(built, k)]
    if {"mlp_ratio", "hidden_dim"} & set(written) and TransformerConfig.of(m).ffn_dim != built.ffn_dim:
        ffn = "hidden_dim" if "hidden_dim" in written else "mlp_ratio"
        wrong.append((ffn, getattr(m, ffn), built.hidden_dim if ffn == "hidden_dim" else built.ffn_dim / built.dim))
    errors = [(k, mine, theirs) for k, mine, theirs in wrong if k in typed]
    problems = ["model.pretrained_from: its config.json gives the encoder's shape, but the command line sets "
                + ", ".join(f"model.{k}={mine!r} (config.json: {theirs!r})" for k, mine, theirs in errors)
                + "; remove these overrides or set them to config.json's values"] if errors else []
    return problems, [f"model.{k}" for k, _, _ in wrong if k not in typed]


def tokenizer_and_spec(model_cfg: ModelConfig, source: SourceRun, max_len: int,
                       given: Collection[str] | None = None) -> tuple[TextTokenizer, dict[str, Any]]:
    """The tokenizer and the encoder spec of a source run (checked against each other)."""
    spec = source_encoder_spec(model_cfg, source, max_len, given)
    tokenizer = TextTokenizer.from_str(source.read_file(TOKENIZER_FILE))
    if tokenizer.vocab_size != spec["vocab_size"]:
        raise TkError(f"model.pretrained_from: {source.spec}'s {TOKENIZER_FILE} has {tokenizer.vocab_size} tokens "
                      f"but its embedding {spec['vocab_size']} rows; give the run dir the checkpoint belongs to")
    return tokenizer, spec


def source_encoder_spec(model_cfg: ModelConfig, source: SourceRun, max_len: int,
                        given: Collection[str] | None = None) -> dict[str, Any]:
    """The encoder of a source run: its config's shape keys (a key the recipe wrote with another
    value is an error, see ``shape_conflicts``), its position table's length (else ``max_len``,
    the run's data.max_len), its embeddings' vocabulary sizes."""
    m = adopt_shape(model_cfg, source.section("model"), SHAPE_KEYS, given)
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
