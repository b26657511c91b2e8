"""Hugging Face decoder LMs in and out of tk's :class:`DecoderOnlyLM`: the family of a
``model_type``, the tk config of a folder, a load that never holds two copies (the model built
on the meta device, tensors read one at a time and assigned, a tied head tied), and the export
of a tk model as the family it came from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.core.errors import TkError
from tk.core.exchange.hf import gemma, gpt2, llama, phi3
from tk.core.exchange.hf.folder import KEY, WeightFiles, read_config
from tk.core.exchange.hf.table import Family, config_to_tk, export_config, export_state, import_state
from tk.core.nn.config import TransformerConfig

FAMILIES: dict[str, Family] = {**gpt2.FAMILIES, **llama.FAMILIES, **phi3.FAMILIES, **gemma.FAMILIES}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the prefix of the *ForCausalLM class's body, which a bare *Model checkpoint lacks
_BODY = {"gpt2": "transformer.", "default": "model."}


def family_of(config: Mapping[str, Any]) -> Family:
    """The family of a ``config.json``.

    Raises:
        TkError: a ``model_type`` tk does not load, with the ones it does.
    """
    kind = config.get("model_type")
    if kind not in FAMILIES:
        also = " (a BERT encoder loads into text_classification / mlm)" if kind == "bert" else ""
        raise TkError(f"{KEY}: model_type {kind!r} is not a decoder tk loads{also}; supported: "
                      f"{', '.join(sorted(FAMILIES))} (SmolLM2 is a llama)")
    return FAMILIES[kind]


def decoder_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The ``TransformerConfig`` fields and the vocabulary size of a decoder ``config.json``.

    Raises:
        TkError: an unsupported ``model_type`` or option (all of them, in one line).
    """
    fields = config_to_tk(family_of(config), config)
    return fields, int(config["vocab_size"])


class _Aliased:
    """A checkpoint of the bare ``*Model`` (no ``model.`` / ``transformer.`` prefix) read under
    the ``*ForCausalLM`` names the tables use."""

    def __init__(self, files: WeightFiles, body: str) -> None:
        self.files, self.folder, self.body = files, files.folder, body
        self._names = {(n if n.startswith(body) or n == "lm_head.weight" else body + n): n for n in files.names()}

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> torch.Tensor:
        return self.files.get(self._names[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(self._names[name])

    def file_dtype(self, name: str) -> torch.dtype:
        return self.files.file_dtype(self._names[name])

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.files.read_into(self._names[name], out)


def resolve_dtype(spec: str, files: WeightFiles, config: Mapping[str, Any]) -> torch.dtype:
    """``model.dtype``: float32 / bfloat16 / float16, or ``auto`` (config.json's ``dtype`` /
    ``torch_dtype``, else the file's first floating tensor)."""
    if spec != "auto":
        return DTYPES[spec]
    named = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(str(named), files.dtype())


def load_decoder(build: Callable[[], nn.Module], folder: Path, dtype: torch.dtype | None = None,
                 config: Mapping[str, Any] | None = None) -> nn.Module:
    """A :class:`DecoderOnlyLM` holding the folder's weights, built by ``build()`` on the meta
    device (no random initialisation, no float32 copy of a bf16 file unless ``dtype`` asks).

    Raises:
        TkError: missing/truncated files or shards, tensors missing, unknown or of another shape.
    """
    config = dict(config or read_config(folder))
    family = family_of(config)
    files = WeightFiles(folder)
    body = _BODY.get(config["model_type"], _BODY["default"])
    view = files if any(n.startswith(body) for n in files.names()) else _Aliased(files, body)
    with torch.device("meta"):
        model = build()
    tied = model.lm_head.weight is model.tok_embed.weight
    state = import_state(family, view, model.state_dict(), len(model.decoder.layers), tied, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.tok_embed.weight
    _materialise_buffers(model)
    return model


def _materialise_buffers(model: nn.Module) -> None:
    """Buffers left on the meta device (rotary frequencies, position tables) computed on the CPU."""
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "reset_buffers"):
                raise TkError(f"{KEY}: {type(module).__name__} cannot be built on the meta device (no reset_buffers)")
            module.reset_buffers("cpu")
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise TkError(f"{KEY}: no weights were read for {left[:3]}")


def export_decoder(model: nn.Module, cfg: TransformerConfig, model_type: str,
                   base: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, tensors)`` of ``model`` as ``model_type`` (a tied head left out).

    Raises:
        TkError: a shape the family cannot express, named.
    """
    family = FAMILIES[model_type]
    sd = {k: v for k, v in model.state_dict().items()}
    for name, module in model.named_modules():  # formats whose LayerNorms always add a bias
        if isinstance(module, nn.LayerNorm) and module.elementwise_affine and module.bias is None:
            sd[f"{name}.bias"] = torch.zeros_like(module.weight)
    if model.lm_head.weight is model.tok_embed.weight:
        sd.pop("lm_head.weight", None)
    vocab = sd["tok_embed.weight"].shape[0]
    config = export_config(family, cfg, model_type, base, vocab)
    config["tie_word_embeddings"] = "lm_head.weight" not in sd
    dtype = next(iter(sd.values())).dtype
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config, export_state(family, sd, cfg)
