"""The seq2seq translator families: Marian (``MarianMTModel``, the opus-mt models) and M2M100
(``M2M100ForConditionalGeneration``: M2M100 and the dense NLLB-200 models), into tk's
:class:`~tk.core.nn.transformer.EncoderDecoder`. Both share layer names; they differ in what
the table below lists.

=========================================  ===========================================
transformers                                tk ``EncoderDecoder``
=========================================  ===========================================
``model.shared``                            ``src_embed`` (= ``tgt_embed`` = ``lm_head``)
``final_logits_bias`` (Marian)              ``logits_bias`` (a buffer there and here)
``model.{encoder,decoder}.layer_norm``      ``{encoder,decoder}.norm`` (M2M100)
``*.layers.{i}.self_attn.{q,k,v}_proj``     ``*.layers.{i}.self_attn.qkv`` (fused rows)
``*.layers.{i}.self_attn.out_proj``         ``*.layers.{i}.self_attn.proj``
``decoder.layers.{i}.encoder_attn.*``       ``decoder.layers.{i}.cross_attn.{q,k,v}_proj``, ``proj``
``self_attn_layer_norm``                    ``norm1``
``encoder_attn_layer_norm``                 ``norm2`` (decoder)
``final_layer_norm``                        ``norm2`` (encoder) / ``norm3`` (decoder)
``fc1`` / ``fc2``                           ``mlp.fc1`` / ``mlp.fc2``
=========================================  ===========================================

Marian: post-norm, no final norms, sinusoids in the ``split`` layout from position 0, SiLU
("swish"), embeddings x sqrt(d). M2M100: pre-norm with final norms, ReLU, ``fairseq`` sinusoids
from position pad + 1 that skip padding. Refused by name: separate source/target vocabularies,
unscaled embeddings, untied heads, encoder and decoder of different widths, an embedding norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tk.core.exchange.hf.table import Family, plain_attention_problems, rows
from tk.core.nn.config import TransformerConfig

ACTS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh"}
ACTS_BACK = {"silu": "swish", "relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
PLAIN = (("d_model", "dim"), ("encoder_layers", "encoder_depth"), ("decoder_layers", "decoder_depth"),
         ("encoder_attention_heads", "num_heads"), ("encoder_ffn_dim", "hidden_dim"),
         ("max_position_embeddings", "max_len"), ("dropout", "dropout"), ("attention_dropout", "attn_dropout"),
         ("activation_dropout", "mlp_dropout"))
_SHARED = {"norm": "layernorm", "norm_eps": 1e-5, "bias": True, "norm_bias": True, "pos_encoding": "sinusoidal",
           "share_embeddings": True, "tie_embeddings": True}
MARIAN_FIXED = {**_SHARED, "norm_first": False, "final_norm": False, "sinusoid_layout": "split", "pos_offset": 0,
                "pad_aware_positions": False, "logits_bias": True}
M2M_FIXED = {**_SHARED, "norm_first": True, "final_norm": True, "sinusoid_layout": "fairseq",
             "pad_aware_positions": True, "logits_bias": False}
MARIAN_DEFAULTS = {"activation_function": "gelu", "scale_embedding": False, "share_encoder_decoder_embeddings": True,
                   "tie_word_embeddings": True, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
                   "max_position_embeddings": 1024}
M2M_DEFAULTS = {"activation_function": "relu", "scale_embedding": True, "tie_word_embeddings": True, "pad_token_id": 1,
                "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0, "max_position_embeddings": 1024}

def _linear(tk: str, hf: str | tuple[str, ...]) -> tuple[tuple[str, str | tuple[str, ...]], ...]:
    """The weight and bias rows of one Linear (of several fused along rows)."""
    return tuple((f"{tk}.{w}", f"{hf}.{w}" if isinstance(hf, str) else tuple(f"{h}.{w}" for h in hf))
                 for w in ("weight", "bias"))


_SELF = _linear("self_attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")) + _linear(
    "self_attn.proj", "self_attn.out_proj")
_CROSS = (_linear("cross_attn.q_proj", "encoder_attn.q_proj") + _linear("cross_attn.k_proj", "encoder_attn.k_proj")
          + _linear("cross_attn.v_proj", "encoder_attn.v_proj") + _linear("cross_attn.proj", "encoder_attn.out_proj"))
_MLP = _linear("mlp.fc1", "fc1") + _linear("mlp.fc2", "fc2")
ENCODER_LAYER = rows(*_SELF, *_MLP, *_linear("norm1", "self_attn_layer_norm"), *_linear("norm2", "final_layer_norm"))
DECODER_LAYER = rows(*_SELF, *_CROSS, *_MLP, *_linear("norm1", "self_attn_layer_norm"),
                     *_linear("norm2", "encoder_attn_layer_norm"), *_linear("norm3", "final_layer_norm"))
_ALIASES = ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


def _common(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    problems = []
    act = ACTS.get(v.get("activation_function"))
    if act is None:
        problems.append(f"activation_function {v.get('activation_function')!r} (supported: {', '.join(ACTS)})")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if v.get(b, v.get(a)) != v.get(a):
            problems.append(f"{b} {v.get(b)} != {a} {v.get(a)} (tk's encoder and decoder share one width)")
    if not v.get("scale_embedding"):
        problems.append("scale_embedding false (tk's encoder-decoders scale embeddings by sqrt(d_model))")
    if not v.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (supported: the head tied to the shared embedding)")
    if v.get("layernorm_embedding") or v.get("normalize_embedding"):
        problems.append("an embedding LayerNorm (layernorm_embedding / normalize_embedding)")
    return {"activation": act, "depth": v["encoder_layers"]}, problems


def _marian_to_tk(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    fields, problems = _common(v)
    if not v.get("share_encoder_decoder_embeddings", True) or v.get("decoder_vocab_size", v["vocab_size"]) != v["vocab_size"]:
        problems.append("separate source and target vocabularies (share_encoder_decoder_embeddings false; tk reads "
                        "the shared vocabulary of opus-mt models)")
    return fields, problems


def _m2m_to_tk(v: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    fields, problems = _common(v)
    fields["pos_offset"] = int(v["pad_token_id"]) + 1  # fairseq's make_positions: pad + 1 is position 0
    return fields, problems


def _to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    problems = []
    act = ACTS_BACK.get(cfg.activation)
    if act is None:
        problems.append(f"model.activation {cfg.activation!r} (supported: {', '.join(ACTS_BACK)})")
    problems += plain_attention_problems(cfg, "the family")
    heads, ffn = cfg.num_heads, cfg.ffn_dim
    return {"activation_function": act, "decoder_attention_heads": heads, "decoder_ffn_dim": ffn,
            "scale_embedding": True, "tie_word_embeddings": True, "attention_dropout": cfg.attn_dropout_p,
            "activation_dropout": cfg.mlp_dropout_p}, problems


def _marian_to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    keys, problems = _to_hf(cfg)
    return {**keys, "share_encoder_decoder_embeddings": True}, problems


def _m2m_to_hf(cfg: TransformerConfig) -> tuple[dict[str, Any], list[str]]:
    keys, problems = _to_hf(cfg)
    return {**keys, "pad_token_id": cfg.pos_offset - 1}, problems


_TOP = rows(("src_embed.weight", "model.shared.weight"))
MARIAN = Family("marian", {"marian": "MarianMTModel"}, PLAIN, MARIAN_FIXED, MARIAN_DEFAULTS, _marian_to_tk,
                _marian_to_hf, _TOP + rows(("logits_bias", "final_logits_bias")), DECODER_LAYER,
                tk_layer="decoder.layers.{i}.", hf_layer="model.decoder.layers.{i}.", ignore=(".embed_positions.weight",),
                aliases=_ALIASES, encoder_layer=ENCODER_LAYER)
M2M100 = Family("m2m_100", {"m2m_100": "M2M100ForConditionalGeneration"}, PLAIN, M2M_FIXED, M2M_DEFAULTS, _m2m_to_tk,
                _m2m_to_hf, _TOP + rows(*_linear("encoder.norm", "model.encoder.layer_norm"),
                                                 *_linear("decoder.norm", "model.decoder.layer_norm")),
                DECODER_LAYER, tk_layer="decoder.layers.{i}.", hf_layer="model.decoder.layers.{i}.",
                ignore=(".embed_positions.weights", ".embed_positions._float_tensor"), aliases=_ALIASES,
                encoder_layer=ENCODER_LAYER)
FAMILIES = {"marian": MARIAN, "m2m_100": M2M100}
