"""The Phi-3 family (Phi-3-mini/medium-4k, Phi-3.5-mini without long-rope): Llama's layout with
fused projections that are tk's already: ``self_attn.qkv_proj`` is ``qkv`` and ``mlp.gate_up_proj``
is ``fc1`` (SwiGLU's [gate; value]); ``sliding_window`` (mini-4k: 2047) on every layer.
Refused by name: ``longrope`` and other rope kinds, partial rotary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tk.core.exchange.hf import llama
from tk.core.exchange.hf.table import Family, rows
from tk.core.nn.config import TransformerConfig

LAYER = rows(
    ("self_attn.qkv.weight", "self_attn.qkv_proj.weight"), ("self_attn.proj.weight", "self_attn.o_proj.weight"),
    ("mlp.fc1.weight", "mlp.gate_up_proj.weight"), ("mlp.fc2.weight", "mlp.down_proj.weight"),
    ("norm1.weight", "input_layernorm.weight"), ("norm2.weight", "post_attention_layernorm.weight"),
)


def _to_tk(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out, problems = llama._to_tk({**v, "model_type": "phi3", "attention_bias": False, "mlp_bias": False})
    out["sliding_window"] = None if v.get("sliding_window") is None else int(v["sliding_window"])
    return out, problems


def _to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    out, problems = llama._to_hf(replace(cfg, sliding_window=None))
    out.pop("attention_bias"), out.pop("mlp_bias")
    out["sliding_window"] = cfg.sliding_window
    if any(cfg.biases()):
        problems.append("biases (Phi-3 has none)")
    return out, problems


PHI3 = Family("phi3", {"phi3": "Phi3ForCausalLM"}, llama.PLAIN, llama.FIXED,
              {**llama.DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "sliding_window": None},
              _to_tk, _to_hf, llama.TOP, LAYER)
FAMILIES = {"phi3": PHI3}
