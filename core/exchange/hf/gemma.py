"""The Gemma family, 1 and 2: Llama's layout plus embeddings times sqrt(D), ``(1 + w)`` RMSNorms
(tk's ``norm_weight_offset: 1``), a tanh-GELU gate (``geglu_tanh``) and an explicit ``head_dim``;
Gemma 2 adds sandwich norms (``post_attention_layernorm`` on the attention output,
``pre/post_feedforward_layernorm`` around the MLP), attention and final-logit soft-capping, the
``query_pre_attn_scalar`` score scale and sliding windows on alternate layers (``layer_types``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tk.core.exchange.hf import llama
from tk.core.exchange.hf.table import Family, rows
from tk.core.nn.config import TransformerConfig

ACTS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}
FIXED = {**llama.FIXED, "activation": None, "norm_weight_offset": 1.0, "scale_embedding": True}
GEMMA2_LAYER = rows(*[(r.tk, r.hf[0] if len(r.hf) == 1 else r.hf) for r in llama.LAYER if r.tk != "norm2.weight"],
                    ("norm2.weight", "pre_feedforward_layernorm.weight"),
                    ("post_norm1.weight", "post_attention_layernorm.weight"),
                    ("post_norm2.weight", "post_feedforward_layernorm.weight"))


def _activation(v: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    act = v.get("hidden_activation") or v.get("hidden_act") or "gelu_pytorch_tanh"
    return (ACTS[act], []) if act in ACTS else (None, [f"hidden_activation {act!r} (supported: {', '.join(ACTS)})"])


def _to_tk(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out, problems = llama._to_tk({**v, "model_type": "gemma", "hidden_act": "silu"})
    out["activation"], more = _activation(v)
    if v.get("model_type") == "gemma2":
        out.update(sandwich_norm=True, attn_logit_softcapping=v.get("attn_logit_softcapping"),
                   final_logit_softcapping=v.get("final_logit_softcapping"),
                   attn_scale=float(v["query_pre_attn_scalar"]) ** -0.5, sliding_window=v.get("sliding_window"))
        if out["sliding_window"] is not None:
            n = v["num_hidden_layers"]
            out["layer_types"] = list(v.get("layer_types") or  # transformers' default: even layers slide
                                      ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    if v.get("use_bidirectional_attention"):
        more.append("use_bidirectional_attention true (tk's decoder is causal)")
    return out, problems + more


def _to_hf(cfg: TransformerConfig, gemma2: bool) -> tuple[dict[str, Any], list[str]]:
    out, problems = llama._to_hf(replace(cfg, activation="swiglu", norm_weight_offset=0.0, scale_embedding=False,
                                         attn_logit_softcapping=None, final_logit_softcapping=None, attn_scale=None,
                                         sandwich_norm=False))
    out.pop("mlp_bias")
    out["hidden_act"] = out["hidden_activation"] = {"geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu"}.get(cfg.activation)
    if out["hidden_act"] is None:
        problems.append(f"model.activation {cfg.activation!r} (Gemma: geglu_tanh or geglu)")
    if cfg.biases()[2]:
        problems.append("MLP biases (Gemma has none)")
    if gemma2:
        problems = [p for p in problems if "sliding_window" not in p]
        if not cfg.sandwich_norm:
            problems.append("model.sandwich_norm false (Gemma 2 always has them)")
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.attn_head_dim ** -0.5
        out.update(attn_logit_softcapping=cfg.attn_logit_softcapping, final_logit_softcapping=cfg.final_logit_softcapping,
                   query_pre_attn_scalar=round(scale ** -2, 6), sliding_window=cfg.sliding_window,
                   layer_types=cfg.layer_types or ["full_attention"] * cfg.depth)
    else:
        names = [n for n in ("attn_logit_softcapping", "final_logit_softcapping", "attn_scale", "sliding_window")
                 if getattr(cfg, n) is not None] + (["sandwich_norm"] if cfg.sandwich_norm else [])
        problems += [f"model.{n} (Gemma 2 has it, Gemma does not)" for n in names]
    return out, problems


GEMMA = Family("gemma", {"gemma": "GemmaForCausalLM"}, llama.PLAIN,
               {k: v for k, v in FIXED.items() if k != "activation"},
               {**llama.DEFAULTS, "tie_word_embeddings": True, "head_dim": 256, "max_position_embeddings": 8192},
               _to_tk, lambda cfg: _to_hf(cfg, False), llama.TOP, llama.LAYER)
GEMMA2 = Family("gemma2", {"gemma2": "Gemma2ForCausalLM"}, llama.PLAIN,
                {k: v for k, v in FIXED.items() if k != "activation"},
                {**llama.DEFAULTS, "tie_word_embeddings": True, "head_dim": 256, "max_position_embeddings": 8192,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                 "final_logit_softcapping": 30.0},
                _to_tk, lambda cfg: _to_hf(cfg, True), llama.TOP, GEMMA2_LAYER)
FAMILIES = {"gemma": GEMMA, "gemma2": GEMMA2}
