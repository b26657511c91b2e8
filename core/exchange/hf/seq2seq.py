"""Hugging Face translators in and out of tk's :class:`EncoderDecoder`: the family of a
``model_type`` (Marian, M2M100/NLLB: :mod:`tk.core.exchange.hf.marian`), the tk config of a
folder, a load that never holds two copies (built on the meta device, tensors read one at a
time and assigned, the shared embedding tied), and the export back to the family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.core.errors import TkError
from tk.core.exchange.hf import marian
from tk.core.exchange.hf.decoders import FAMILIES as DECODERS
from tk.core.exchange.hf.decoders import _materialise_buffers
from tk.core.exchange.hf.folder import KEY, WeightFiles, read_config
from tk.core.exchange.hf.table import Family, config_to_tk, export_config, export_state, import_state
from tk.core.nn.config import TransformerConfig

FAMILIES: dict[str, Family] = dict(marian.FAMILIES)
NAMES = "marian (opus-mt), m2m_100 (M2M100, NLLB-200)"


def seq2seq_family(config: Mapping[str, Any]) -> Family:
    """The translator family of a ``config.json``.

    Raises:
        TkError: a ``model_type`` tk does not load as a translator (a decoder LM named as such).
    """
    kind = config.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    if kind in DECODERS:
        raise TkError(f"{KEY}: model_type {kind!r} is a decoder-only language model, not a translator; start the "
                      f"language_model or sft task from it, or give translation a {NAMES} folder")
    raise TkError(f"{KEY}: model_type {kind!r} is not a translator tk loads; supported: {NAMES}")


def seq2seq_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The ``TransformerConfig`` fields and the vocabulary size of a translator ``config.json``.

    Raises:
        TkError: an unsupported ``model_type`` or option (all of them, in one line).
    """
    family = seq2seq_family(config)
    need = ["vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "encoder_ffn_dim"]
    missing = [k for k in need if config.get(k) is None]
    if missing:
        raise TkError(f"{KEY}: this {config['model_type']} config.json lacks {', '.join(missing)}; it is not a "
                      f"complete transformers config (save it again with save_pretrained)")
    return config_to_tk(family, config), int(config["vocab_size"])


def _own(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the file fills: a shared source/target embedding and a tied head once."""
    sd = model.state_dict()
    if model.tgt_embed is model.src_embed:
        sd.pop("tgt_embed.weight", None)
    if model.lm_head.weight is model.tgt_embed.weight:
        sd.pop("lm_head.weight", None)
    return sd


def load_seq2seq(build: Callable[[], nn.Module], folder: Path, dtype: torch.dtype | None = None,
                 config: Mapping[str, Any] | None = None) -> nn.Module:
    """An :class:`EncoderDecoder` holding the folder's weights, built by ``build()`` on the meta
    device (no random initialisation, no float32 copy of a bf16 file unless ``dtype`` asks).

    Raises:
        TkError: missing/truncated files, tensors missing, unknown or of another shape.
    """
    config = dict(config or read_config(folder))
    family = seq2seq_family(config)
    files = WeightFiles(folder)
    with torch.device("meta"):
        model = build()
    shared = model.tgt_embed is model.src_embed and model.lm_head.weight is model.tgt_embed.weight
    depths = (len(model.encoder.layers), len(model.decoder.layers))
    state = import_state(family, files, _own(model), depths, shared, dtype)
    if model.logits_bias is not None:  # a buffer: cast as the weights are
        state["logits_bias"] = state["logits_bias"].to(state["src_embed.weight"].dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tgt_embed = model.src_embed
    model.lm_head.weight = model.src_embed.weight
    _materialise_buffers(model)
    return model


def export_seq2seq(model: nn.Module, cfg: TransformerConfig, model_type: str,
                   base: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, tensors)`` of ``model`` as ``model_type`` (the tied embedding once, as
    transformers saves it).

    Raises:
        TkError: a shape the family cannot express, named.
    """
    family = FAMILIES[model_type]
    if model.tgt_embed is not model.src_embed or model.lm_head.weight is not model.src_embed.weight:
        raise TkError(f"--format hf: {family.architectures[model_type]} shares one embedding between source, target "
                      f"and output; this model has separate ones; export --format safetensors instead")
    sd = _own(model)
    config = export_config(family, cfg, model_type, base, sd["src_embed.weight"].shape[0])
    dtype = sd["src_embed.weight"].dtype
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if model_type == "marian":
        config["decoder_vocab_size"] = config["vocab_size"]
    return config, export_state(family, sd, cfg)
