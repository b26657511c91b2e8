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
from tk.core.exchange.hf.table import Family, config_to_tk, export_config, export_state, import_state, plan_import, read_tensor
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
        also = (" (a BERT encoder loads into text_classification / mlm)" if kind == "bert" else
                " (a translator, encoder-decoder: start the translation task from it)" if kind in ("marian", "m2m_100")
                else "")
        raise TkError(f"{KEY}: model_type {kind!r} is not a decoder tk loads{also}; supported: "
                      f"{', '.join(sorted(FAMILIES))} (SmolLM2 is a llama)")
    return FAMILIES[kind]


def decoder_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The ``TransformerConfig`` fields and the vocabulary size of a decoder ``config.json``.

    Raises:
        TkError: an unsupported ``model_type`` or option (all of them, in one line).
    """
    family = family_of(config)
    need = ["vocab_size", *(k for k, _ in family.plain if k not in family.defaults)]
    missing = [k for k in need if config.get(k) is None and k != "num_key_value_heads"]
    if missing:
        raise TkError(f"{KEY}: this {config['model_type']} config.json lacks {', '.join(missing)}; it is not a "
                      f"complete transformers config (save it again with save_pretrained)")
    return config_to_tk(family, config), int(config["vocab_size"])


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
                 config: Mapping[str, Any] | None = None, defer: bool = False) -> nn.Module:
    """A :class:`DecoderOnlyLM` holding the folder's weights, built by ``build()`` on the meta
    device (no random initialisation, no float32 copy of a bf16 file unless ``dtype`` asks).

    ``defer``: every name checked, but the weights stay on the meta device; the model carries
    ``model.tk_fill_weights(model)``, which FSDP calls once it has sharded the model, so that each
    process reads, tensor by tensor, and keeps only its own shards (see
    :func:`tk.core.training.parallel.wrap_fsdp`).

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
    if defer:
        plan = plan_import(family, view, model.state_dict(), len(model.decoder.layers), tied)
        _materialise_buffers(model, params=False)
        model.tk_fill_weights = lambda m: _fill_shards(m, view, plan, dtype)
        return model
    state = import_state(family, view, model.state_dict(), len(model.decoder.layers), tied, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.tok_embed.weight
    _materialise_buffers(model)
    return model


def _materialise_buffers(model: nn.Module, params: bool = True, device: torch.device | str = "cpu",
                         every: bool = False) -> None:
    """Buffers left on the meta device (rotary frequencies, position tables) computed on ``device``
    (``every``: all of them, after ``to_empty``); then no parameter may be left there."""
    for module in model.modules():
        if any(every or b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "reset_buffers"):
                raise TkError(f"{KEY}: {type(module).__name__} cannot be built on the meta device (no reset_buffers)")
            module.reset_buffers(device)
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if params and left:
        raise TkError(f"{KEY}: no weights were read for {left[:3]}")


@torch.no_grad()
def _fill_shards(model: nn.Module, files: Any, plan: Mapping[str, Any], dtype: torch.dtype | None) -> None:
    """After ``fully_shard`` + ``to_empty``: each parameter's local shard from the files, one full
    tensor at a time (read, sliced by ``distribute_tensor``, dropped)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        key = name.replace("._checkpoint_wrapped_module", "")
        full = read_tensor(files, plan[key], key, tuple(param.shape), dtype)
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(full)
    device = next(model.parameters()).device
    _materialise_buffers(model, device=device, every=True)


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
