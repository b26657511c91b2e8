"""tk.core: Transformer parts and the training engine, shared by every task plugin.

The public API is re-exported here by name (``from tk.core import MultiHeadAttention``).
Exports load lazily (PEP 562), so ``import tk.core.registry`` — what ``tk list`` and
``tk --version`` need — does not pull in every torch module.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # attention and masks
    "MultiHeadAttention": "attention", "KVCache": "attention",
    "scaled_dot_product_attention": "attention", "attention_reference": "attention",
    "padding_mask": "masks", "causal_mask": "masks", "merge_masks": "masks",
    "to_additive": "masks", "from_additive": "masks",
    # positional encodings
    "SinusoidalPositionalEncoding": "pos_embed", "LearnedPositionalEmbedding": "pos_embed",
    "RotaryEmbedding": "pos_embed", "TokenEmbedding": "pos_embed", "resample_pos_embed": "pos_embed",
    # layers, blocks, stacks, ViT
    "Mlp": "layers", "DropPath": "layers", "RMSNorm": "layers", "build_norm": "layers",
    "EncoderLayer": "blocks", "DecoderLayer": "blocks", "DecoderOnlyLayer": "blocks",
    "TransformerEncoder": "transformer", "TransformerDecoder": "transformer",
    "EncoderDecoder": "transformer", "DecoderOnlyLM": "transformer", "DecoderCache": "transformer",
    "VisionTransformer": "vit", "convert_timm_vit_state_dict": "vit", "load_timm_vit": "vit",
    # generation
    "generate": "generation", "GenerationConfig": "generation", "greedy_decode": "generation",
    "beam_search": "generation", "sample": "generation",
    # the task contract and the engine
    "Task": "task", "StepOutput": "task", "LoaderSpec": "data", "TkError": "errors",
    "RunConfig": "config", "TrainConfig": "config", "load_config": "config",
    "available_tasks": "registry", "load_task": "registry",
    "Trainer": "train", "Metric": "metrics", "Accuracy": "metrics", "Mean": "metrics",
    "OptimConfig": "optim", "build_optimizer": "optim", "ScheduleConfig": "schedule",
    "build_scheduler": "schedule", "ModelEMA": "ema", "Precision": "precision",
    "CheckpointManager": "checkpoint", "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tk.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tk.core.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
