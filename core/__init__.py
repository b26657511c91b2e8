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
    "MultiHeadAttention": "nn.attention", "KVCache": "nn.kv_cache",
    "scaled_dot_product_attention": "nn.attention", "attention_reference": "nn.attention",
    "padding_mask": "nn.masks", "causal_mask": "nn.masks", "merge_masks": "nn.masks",
    "to_additive": "nn.masks", "from_additive": "nn.masks",
    # positional encodings
    "SinusoidalPositionalEncoding": "nn.pos_embed", "LearnedPositionalEmbedding": "nn.pos_embed",
    "RotaryEmbedding": "nn.rope", "TokenEmbedding": "nn.pos_embed", "resample_pos_embed": "nn.pos_embed",
    # model configs, layers, blocks, stacks, ViT
    "TransformerConfig": "nn.config", "ViTConfig": "nn.config",
    "Mlp": "nn.layers", "DropPath": "nn.layers", "RMSNorm": "nn.layers", "build_norm": "nn.layers",
    "EncoderLayer": "nn.blocks", "DecoderLayer": "nn.blocks", "DecoderOnlyLayer": "nn.blocks",
    "TransformerStack": "nn.stack", "DecoderCache": "nn.stack",
    "TransformerEncoder": "nn.transformer", "TransformerDecoder": "nn.transformer",
    "EncoderDecoder": "nn.transformer", "DecoderOnlyLM": "nn.lm",
    "LoRAConfig": "nn.lora", "LoRALinear": "nn.lora", "apply_lora": "nn.lora", "merge_lora": "nn.lora",
    "merged_state_dict": "nn.lora",
    "VisionTransformer": "nn.vit", "convert_timm_vit_state_dict": "nn.vit", "load_timm_vit": "nn.vit",
    # generation
    "generate": "nn.generation", "GenerationConfig": "nn.generation", "GenerationOutput": "nn.generation",
    "greedy_decode": "nn.generation",
    "beam_search": "nn.generation", "sample": "nn.generation",
    # the task contract and the engine
    "Task": "task", "StepOutput": "step", "TkError": "errors", "RunError": "errors",
    # data loading
    "LoaderSpec": "data.loader", "build_loader": "data.loader", "build_sampler": "data.loader",
    "WorkerSeeding": "data.loader", "TokenBudgetBatchSampler": "data.samplers",
    "RandomIndexSampler": "data.samplers", "RandomBlockSampler": "data.samplers",
    "RunConfig": "config", "TrainConfig": "config", "load_config": "recipe",
    "available_tasks": "registry", "load_task": "registry",
    "Trainer": "engine.train", "Metric": "metrics", "Accuracy": "metrics", "Mean": "metrics",
    "cross_entropy_sum": "losses", "kl_distillation_loss": "losses",
    "DistillConfig": "distill", "distillation_loss": "distill", "load_teacher_run": "distill",
    "TeacherLogitsCache": "distill",
    "OptimConfig": "optim", "build_optimizer": "optim", "ScheduleConfig": "schedule",
    "build_scheduler": "schedule", "ModelEMA": "training.ema", "Precision": "training.precision",
    "CheckpointManager": "run.checkpoint", "save_checkpoint": "run.checkpoint", "export_safetensors": "exchange.export", "average_checkpoints": "exchange.export", "load_checkpoint": "run.checkpoint",
    # the run lifecycle, task files, evaluation context, metrics, loading runs
    "EvalContext": "step", "TaskFiles": "artifacts", "assemble": "training.assemble", "AssembledRun": "training.assemble",
    "MetricCollection": "metrics", "param_groups": "optim", "move_to_device": "training.device",
    "load_run": "engine.inference", "evaluate_run": "engine.inference", "average_run": "engine.inference",
    "TrainingInterrupted": "training.signals",
    "main_process_first": "distributed", "is_main_process": "distributed",
    # prediction, plugin discovery, config docs
    "predict_run": "engine.inference", "discover_commands": "registry", "field_docs": "cli.docs",
    # media a metric logs at evaluations (images, text) through every logger
    "Image": "media", "Text": "media",
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
