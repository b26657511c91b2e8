"""The Llama family: Llama 2 and 3.x, SmolLM2 (a Llama), Mistral, Qwen2/2.5 and Qwen3, all
``model.layers.{i}.self_attn.{q,k,v,o}_proj`` + ``mlp.{gate,up,down}_proj`` + two RMSNorms.

=======================================  ==========================================
transformers                              tk ``DecoderOnlyLM``
=======================================  ==========================================
``model.embed_tokens``                    ``tok_embed``
``layers.{i}.self_attn.{q,k,v}_proj``     ``decoder.layers.{i}.self_attn.qkv`` (stacked rows)
``layers.{i}.self_attn.o_proj``           ``decoder.layers.{i}.self_attn.proj``
``layers.{i}.self_attn.{q,k}_norm``       ``decoder.layers.{i}.self_attn.{q,k}_norm`` (Qwen3)
``layers.{i}.mlp.{gate,up}_proj``         ``decoder.layers.{i}.mlp.fc1`` (SwiGLU's [gate; value])
``layers.{i}.mlp.down_proj``              ``decoder.layers.{i}.mlp.fc2``
``layers.{i}.input_layernorm``            ``decoder.layers.{i}.norm1``
``layers.{i}.post_attention_layernorm``   ``decoder.layers.{i}.norm2`` (the pre-MLP norm)
``model.norm`` / ``lm_head``              ``decoder.norm`` / ``lm_head``
=======================================  ==========================================

Config: ``rope_theta``/``rope_parameters`` (default, linear, llama3), ``head_dim``, GQA,
``attention_bias`` (q/k/v and o) or Qwen2's q/k/v-only biases, ``mlp_bias``, Mistral's
``sliding_window``. Refused by name: another ``hidden_act``, other rope kinds, partial rotary,
Qwen's ``use_sliding_window``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tk.core.exchange.hf.rope_keys import rope_to_hf, rope_to_tk
from tk.core.exchange.hf.table import Family, rows
from tk.core.nn.config import TransformerConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
PLAIN = (("hidden_size", "dim"), ("num_hidden_layers", "depth"), ("num_attention_heads", "num_heads"),
         ("num_key_value_heads", "num_kv_heads"), ("intermediate_size", "hidden_dim"), ("rms_norm_eps", "norm_eps"),
         ("max_position_embeddings", "max_len"), ("tie_word_embeddings", "tie_embeddings"))
FIXED = {"norm": "rmsnorm", "activation": "swiglu", "pos_encoding": "rotary", "norm_first": True, "final_norm": True}
# LlamaConfig's defaults (the other classes differ only where noted in to_tk)
DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
TOP = rows(("tok_embed.weight", "model.embed_tokens.weight"), ("decoder.norm.weight", "model.norm.weight"),
           ("lm_head.weight", "lm_head.weight"))
LAYER = rows(
    ("self_attn.qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("self_attn.qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    ("self_attn.q_norm.weight", "self_attn.q_norm.weight"), ("self_attn.k_norm.weight", "self_attn.k_norm.weight"),
    ("self_attn.proj.weight", "self_attn.o_proj.weight"), ("self_attn.proj.bias", "self_attn.o_proj.bias"),
    ("mlp.fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    ("mlp.fc2.weight", "mlp.down_proj.weight"), ("mlp.fc2.bias", "mlp.down_proj.bias"),
    ("norm1.weight", "input_layernorm.weight"), ("norm2.weight", "post_attention_layernorm.weight"),
)


def head_dim_to_tk(v: Mapping[str, Any]) -> dict[str, Any]:
    """``head_dim`` only where it is not ``hidden_size // num_attention_heads``."""
    implied = v["hidden_size"] // v["num_attention_heads"]
    hd = v.get("head_dim")
    return {"head_dim": None if hd in (None, implied) and v["hidden_size"] % v["num_attention_heads"] == 0 else hd}


def _to_tk(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    kind = v.get("model_type")
    out, problems = rope_to_tk(v)
    out.update(head_dim_to_tk(v))
    if v.get("hidden_act") != "silu":
        problems.append(f"hidden_act {v.get('hidden_act')!r} (the family's SwiGLU: 'silu')")
    if kind == "qwen2":  # q/k/v biases, none elsewhere
        out.update(bias=False, qkv_bias=True, proj_bias=False, mlp_bias=False)
    else:
        attn = bool(v.get("attention_bias", False))
        out.update(bias=False, qkv_bias=attn, proj_bias=attn, mlp_bias=bool(v.get("mlp_bias", False)))
    out["qk_norm"] = kind == "qwen3"
    out["sliding_window"] = None
    if kind == "mistral" and v.get("sliding_window") is not None:
        out["sliding_window"] = int(v["sliding_window"])
    if kind in ("qwen2", "qwen3") and v.get("use_sliding_window"):
        problems.append("use_sliding_window true (Qwen's per-layer windows, max_window_layers; supported: false)")
    return out, problems


def _to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    qkv, proj, mlp = cfg.biases()
    out = {"hidden_act": "silu", "head_dim": cfg.attn_head_dim, "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
           "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, **rope_to_hf(cfg)}
    problems = []
    if qkv != proj:
        problems.append(f"q/k/v bias {qkv} with output bias {proj} (only Qwen2 has q/k/v biases alone)")
    out.update(attention_bias=qkv, mlp_bias=mlp)
    if cfg.qk_norm:
        problems.append("model.qk_norm true (Qwen3 has it)")
    if cfg.sliding_window is not None:
        problems.append(f"model.sliding_window {cfg.sliding_window} (Mistral has it)")
    return out, problems + _common_refusals(cfg)


def _common_refusals(cfg: TransformerConfig) -> list[str]:
    """Fields none of the Llama family's classes express."""
    names = ("attn_logit_softcapping", "final_logit_softcapping", "attn_scale")
    found = [f"model.{n} {getattr(cfg, n)}" for n in names if getattr(cfg, n) is not None]
    found += [f"model.{n} true" for n in ("sandwich_norm", "scale_embedding") if getattr(cfg, n)]
    if cfg.norm_weight_offset:
        found.append(f"model.norm_weight_offset {cfg.norm_weight_offset}")
    return found


def _qwen2_to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    out, problems = _to_hf(cfg)
    qkv, proj, mlp = cfg.biases()
    problems = [p for p in problems if not p.startswith("q/k/v bias")]
    if not qkv or proj or mlp:
        problems.append(f"biases q/k/v {qkv}, output {proj}, MLP {mlp} (Qwen2: q/k/v only)")
    out.pop("attention_bias"), out.pop("mlp_bias")
    out.update(use_sliding_window=False, sliding_window=None)
    return out, problems


def _qwen3_to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    out, problems = _to_hf(replace(cfg, qk_norm=False))
    if not cfg.qk_norm:
        problems.append("model.qk_norm false (Qwen3 always normalises q and k)")
    out.update(use_sliding_window=False, sliding_window=None)
    return out, problems


def _mistral_to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    out, problems = _to_hf(replace(cfg, sliding_window=None))
    out["sliding_window"] = cfg.sliding_window
    out.pop("attention_bias"), out.pop("mlp_bias")
    if any(cfg.biases()):
        problems.append("biases (Mistral has none)")
    if cfg.layer_types is not None:
        problems.append("model.layer_types (Mistral windows every layer)")
    return out, problems


def _family(to_hf: Any, defaults: Mapping[str, Any] = {}) -> Family:
    return Family("llama", ARCHITECTURES, PLAIN, FIXED, {**DEFAULTS, **defaults}, _to_tk, to_hf, TOP, LAYER)


LLAMA = _family(_to_hf)
MISTRAL = _family(_mistral_to_hf, {"max_position_embeddings": 4096 * 32, "sliding_window": 4096})
QWEN2 = _family(_qwen2_to_hf, {"max_position_embeddings": 32768})
QWEN3 = _family(_qwen3_to_hf, {"max_position_embeddings": 32768, "head_dim": 128})
FAMILIES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}
