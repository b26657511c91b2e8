"""The GPT-2 family (``GPT2LMHeadModel``): learned positions, pre-norm LayerNorms with biases,
fused ``c_attn`` (tk's ``qkv``) and ``Conv1D`` layers that store weights (in, out), i.e. the
transpose of ``nn.Linear``'s; ``gelu_new`` is tk's ``gelu_tanh``.

==============================  ===============================
transformers                     tk ``DecoderOnlyLM``
==============================  ===============================
``transformer.wte`` / ``wpe``    ``tok_embed`` / ``pos``
``h.{i}.ln_1`` / ``ln_2``        ``decoder.layers.{i}.norm1`` / ``norm2``
``h.{i}.attn.c_attn``            ``decoder.layers.{i}.self_attn.qkv`` (transposed)
``h.{i}.attn.c_proj``            ``decoder.layers.{i}.self_attn.proj`` (transposed)
``h.{i}.mlp.c_fc`` / ``c_proj``  ``decoder.layers.{i}.mlp.fc1`` / ``fc2`` (transposed)
``transformer.ln_f``             ``decoder.norm``
==============================  ===============================

Refused by name: ``scale_attn_by_inverse_layer_idx``, ``scale_attn_weights: false``, an
``activation_function`` tk lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tk.core.exchange.hf.table import Family, plain_attention_problems, rows
from tk.core.nn.config import TransformerConfig

ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": None, "gelu": "gelu", "relu": "relu",
        "silu": "silu", "swish": "silu"}
PLAIN = (("n_embd", "dim"), ("n_layer", "depth"), ("n_head", "num_heads"), ("n_positions", "max_len"),
         ("layer_norm_epsilon", "norm_eps"), ("tie_word_embeddings", "tie_embeddings"))
FIXED = {"norm": "layernorm", "pos_encoding": "learned", "norm_first": True, "final_norm": True, "bias": True}
DEFAULTS = {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}
TOP = rows(("tok_embed.weight", "transformer.wte.weight"), ("pos.weight", "transformer.wpe.weight"),
           ("decoder.norm.weight", "transformer.ln_f.weight"), ("decoder.norm.bias", "transformer.ln_f.bias"),
           ("lm_head.weight", "lm_head.weight"))
LAYER = rows(
    ("norm1.weight", "ln_1.weight"), ("norm1.bias", "ln_1.bias"), ("norm2.weight", "ln_2.weight"),
    ("norm2.bias", "ln_2.bias"),
    ("self_attn.qkv.weight", "attn.c_attn.weight", True), ("self_attn.qkv.bias", "attn.c_attn.bias"),
    ("self_attn.proj.weight", "attn.c_proj.weight", True), ("self_attn.proj.bias", "attn.c_proj.bias"),
    ("mlp.fc1.weight", "mlp.c_fc.weight", True), ("mlp.fc1.bias", "mlp.c_fc.bias"),
    ("mlp.fc2.weight", "mlp.c_proj.weight", True), ("mlp.fc2.bias", "mlp.c_proj.bias"),
)


def _to_tk(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    problems = []
    act = ACTS.get(v.get("activation_function"))
    if act is None:
        problems.append(f"activation_function {v.get('activation_function')!r} "
                        f"(supported: {', '.join(k for k, a in ACTS.items() if a)})")
    if v.get("scale_attn_by_inverse_layer_idx"):
        problems.append("scale_attn_by_inverse_layer_idx true (supported: false)")
    if not v.get("scale_attn_weights", True):
        problems.append("scale_attn_weights false (supported: true)")
    if v.get("add_cross_attention"):
        problems.append("add_cross_attention true (a decoder-only LM has none)")
    # norm_bias: imported with; a tk model without LayerNorm biases exports zeros (the same function)
    return {"activation": act, "hidden_dim": v.get("n_inner") or 4 * v["n_embd"], "norm_bias": True}, problems


def _to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    problems = []
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}.get(cfg.activation)
    if act is None:
        problems.append(f"model.activation {cfg.activation!r} (GPT-2: gelu_tanh, gelu, relu, silu)")
    problems += plain_attention_problems(cfg, "GPT-2", ("qk_norm", "sandwich_norm", "scale_embedding"))
    return {"activation_function": act, "n_inner": cfg.ffn_dim, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False}, problems


GPT2 = Family("gpt2", {"gpt2": "GPT2LMHeadModel"}, PLAIN, FIXED, DEFAULTS, _to_tk, _to_hf, TOP, LAYER,
              tk_layer="decoder.layers.{i}.", hf_layer="transformer.h.{i}.", ignore=(".attn.bias", ".attn.masked_bias"))
FAMILIES = {"gpt2": GPT2}
