"""Convert a Hugging Face BERT-family checkpoint folder into the core :class:`TextEncoder`.

A folder as ``save_pretrained`` writes it: ``config.json`` plus ``model.safetensors`` or
``pytorch_model.bin`` (BERT, MiniLM and other ``BertModel`` checkpoints). The mapping:

=====================================================  ==============================
Hugging Face ``BertModel``                              core ``TextEncoder``
=====================================================  ==============================
``embeddings.word_embeddings``                          ``tok_embed``
``embeddings.position_embeddings``                      ``pos_embed``
``embeddings.token_type_embeddings``                    ``type_embed``
``embeddings.LayerNorm``                                ``embed_norm``
``encoder.layer.{i}.attention.self.{query,key,value}``  ``encoder.layers.{i}.self_attn.qkv`` (stacked)
``encoder.layer.{i}.attention.output.dense``            ``encoder.layers.{i}.self_attn.proj``
``encoder.layer.{i}.attention.output.LayerNorm``        ``encoder.layers.{i}.norm1``
``encoder.layer.{i}.intermediate.dense``                ``encoder.layers.{i}.mlp.fc1``
``encoder.layer.{i}.output.dense``                      ``encoder.layers.{i}.mlp.fc2``
``encoder.layer.{i}.output.LayerNorm``                  ``encoder.layers.{i}.norm2``
=====================================================  ==============================

BERT is post-norm with exact GELU, learned absolute positions, token types and an
embedding LayerNorm; the pooler is read apart (:func:`read_bert_pooler`: a text classifier's
``model.pooler``). Config options the core encoder does not
implement (e.g. ``position_embedding_type`` other than ``absolute``) raise naming them.

:func:`resolve_pretrained_dir` turns a Hugging Face hub id (e.g.
``sentence-transformers/all-MiniLM-L6-v2``) into a local folder with
``huggingface_hub.snapshot_download`` when no folder of that name exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tk.core.errors import TkError
from tk.core.exchange.export import read_weights
from tk.core.nn.config import TransformerConfig

__all__ = ["is_hub_id", "bert_config", "bert_state_dict", "load_bert_weights", "read_bert_config",
           "resolve_pretrained_dir"]

_ACTIVATIONS = {"gelu": "gelu", "relu": "relu"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # "name" or "owner/name"
# what the converter and the tokenizer loader read (not the TF/ONNX/Flax copies a hub repo may hold)
_HUB_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors",
              "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja", "vocab.txt", "source.spm", "target.spm", "vocab.json"]


def is_hub_id(spec: str | Path) -> bool:
    """Whether ``spec`` has the form of a hub id (``name`` or ``owner/name``), not of a path."""
    return bool(_HUB_ID.fullmatch(str(spec)))


def resolve_pretrained_dir(spec: str | Path) -> Path:
    """A local checkpoint folder for ``spec``: the path itself when it exists, else (a hub id
    such as ``owner/name``) the folder ``huggingface_hub.snapshot_download`` fetches it into.

    Raises:
        TkError: neither a folder on disk nor a hub id, or the download fails (offline, no such
            repository), named.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    head = Path(str(spec).split("/")[0]).expanduser()
    if str(spec).startswith((".", "/", "~")) or (head.is_dir() and "/" in str(spec)):  # a path, not a hub id
        inside = sorted(p.name for p in path.parent.iterdir())[:6] if path.parent.is_dir() else []
        raise TkError(f"model.pretrained_from: {path} does not exist"
                      + (f" ({path.parent} holds {', '.join(inside)})" if inside else "")
                      + "; point it at a tk run dir or a Hugging Face model folder")
    if not is_hub_id(spec):
        raise TkError(f"model.pretrained_from: {path} does not exist; point it at a tk run dir or a Hugging Face "
                      f"model folder, or give a hub id such as 'sentence-transformers/all-MiniLM-L6-v2'")
    try:
        import huggingface_hub  # lazy: only a hub id needs it (installed with datasets)
    except ImportError as e:
        raise TkError(f"model.pretrained_from: {spec!r} is not a folder on disk, and huggingface_hub (to download "
                      f"it as a hub id) is not installed; pip install huggingface_hub, or give a local folder") from e
    try:
        return Path(huggingface_hub.snapshot_download(repo_id=str(spec), allow_patterns=_HUB_FILES))
    except Exception as e:  # the hub client raises many kinds (offline, missing repo, auth)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TkError(f"model.pretrained_from: {spec!r} is no path on disk, and as a Hugging Face hub id it could not "
                      f"be fetched ({first}); check the path, or the network and the id") from e


def read_bert_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder, as a dict.

    Raises:
        TkError: the folder or its config.json is missing or unreadable.
    """
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise TkError(f"model.pretrained_from: {path} does not exist; point it at a tk run dir, a Hugging Face model folder "
                      f"(config.json, model.safetensors or pytorch_model.bin, tokenizer.json or vocab.txt)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TkError(f"model.pretrained_from: cannot read {path}: {e}") from e


def bert_config(hf: dict[str, Any], dropout: float | None = None) -> tuple[TransformerConfig, int, int]:
    """A core config for a Hugging Face BERT ``config.json`` dict.

    Args:
        hf: the parsed config.json.
        dropout: override ``hidden_dropout_prob`` (and the attention dropout); None keeps them.

    Returns:
        ``(cfg, vocab_size, type_vocab_size)``.

    Raises:
        TkError: a model type or option the core encoder does not implement, named.
    """
    problems = []
    if hf.get("model_type", "bert") not in ("bert",):
        problems.append(f"model_type {hf.get('model_type')!r} (only 'bert' checkpoints convert)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {hf['position_embedding_type']!r} (only 'absolute')")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        problems.append(f"hidden_act {act!r} (only gelu, relu)")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        problems.append("is_decoder/add_cross_attention (encoder checkpoints only)")
    if problems:
        raise TkError("model.pretrained_from: unsupported config.json options: " + "; ".join(problems))
    hidden_drop = hf.get("hidden_dropout_prob", 0.1) if dropout is None else dropout
    attn_drop = hf.get("attention_probs_dropout_prob", 0.1) if dropout is None else dropout
    cfg = TransformerConfig(
        dim=hf["hidden_size"], depth=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        hidden_dim=hf["intermediate_size"], activation=_ACTIVATIONS[act], norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-12), norm_first=False, final_norm=False, bias=True,
        dropout=hidden_drop, attn_dropout=attn_drop, mlp_dropout=0.0, pos_encoding="learned",
        max_len=hf.get("max_position_embeddings", 512),
    )
    return cfg, hf["vocab_size"], hf.get("type_vocab_size", 2)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return read_weights(folder / name, "model.pretrained_from")
    raise TkError(f"model.pretrained_from: {folder} has neither model.safetensors nor pytorch_model.bin")


def bert_state_dict(hf_state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Rename (and stack q/k/v of) a ``BertModel`` state dict into ``TextEncoder`` names.

    A leading ``bert.`` (task-head checkpoints) is stripped; heads and the pooler are dropped.

    Raises:
        TkError: a tensor the encoder needs is missing, named.
    """
    sd = {k.removeprefix("bert."): v for k, v in hf_state.items()}

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise TkError(f"model.pretrained_from: the checkpoint has no tensor {name!r}; is it a BERT encoder?")
        return sd[name]

    out = {"tok_embed.weight": take("embeddings.word_embeddings.weight"),
           "pos_embed.weight": take("embeddings.position_embeddings.weight"),
           "embed_norm.weight": take("embeddings.LayerNorm.weight"),
           "embed_norm.bias": take("embeddings.LayerNorm.bias")}
    if "embeddings.token_type_embeddings.weight" in sd:
        out["type_embed.weight"] = sd["embeddings.token_type_embeddings.weight"]
    for i in range(depth):
        src, dst = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}self_attn.qkv.{kind}"] = torch.cat(
                [take(f"{src}attention.self.{n}.{kind}") for n in ("query", "key", "value")])
            for a, b in (("attention.output.dense", "self_attn.proj"), ("attention.output.LayerNorm", "norm1"),
                         ("intermediate.dense", "mlp.fc1"), ("output.dense", "mlp.fc2"),
                         ("output.LayerNorm", "norm2")):
                out[f"{dst}{b}.{kind}"] = take(f"{src}{a}.{kind}")
    return out


def read_bert_pooler(folder: str | Path) -> dict[str, torch.Tensor] | None:
    """The pooler (dense + tanh on [CLS]) of a BERT checkpoint folder as ``{"weight", "bias"}``,
    or None when the checkpoint has none (e.g. a ``BertForMaskedLM``)."""
    sd = {k.removeprefix("bert."): v for k, v in _read_weights(Path(folder).expanduser()).items()}
    if "pooler.dense.weight" not in sd:
        return None
    return {"weight": sd["pooler.dense.weight"], "bias": sd["pooler.dense.bias"]}


def load_bert_weights(encoder: torch.nn.Module, folder: str | Path) -> None:
    """Copy a checkpoint folder's weights into ``encoder`` (a :class:`TextEncoder` built from
    :func:`bert_config` of the same folder).

    Raises:
        TkError: missing files or tensors, or shapes that do not match the built encoder.
    """
    folder = Path(folder).expanduser()
    state = bert_state_dict(_read_weights(folder), len(encoder.encoder.layers))
    try:
        missing, unexpected = encoder.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise TkError(f"model.pretrained_from: {folder} does not fit the encoder built from its config.json: "
                      f"{str(e).splitlines()[0]}") from e
    missing = [k for k in missing if not k.endswith("rotary.inv_freq")]
    if missing or unexpected:
        raise TkError(f"model.pretrained_from: {folder}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
