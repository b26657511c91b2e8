"""Exporting weights: safetensors files, and averaging the weights of several checkpoints.

Checkpoint averaging: "Attention Is All You Need" (https://arxiv.org/abs/1706.03762), sec. 6.1.
safetensors: https://huggingface.co/docs/safetensors
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors.torch import save as st_save
from torch import nn

from tk.core.errors import TkError
from tk.core.nn.lora import merged_state_dict
from tk.core.run.atomic import atomic_write
from tk.core.run.checkpoint import load_checkpoint

__all__ = ["export_safetensors", "average_checkpoints", "read_weights", "state_with_norm_biases", "tk_metadata",
           "weights_file_problem"]


def weights_file_problem(path: str | Path, key: str) -> str | None:
    """Why a weights file cannot be read, found cheaply (a safetensors header, a zip's directory:
    a truncated file fails both) before a run starts; None when it looks whole."""
    file = Path(path).expanduser()
    if not file.is_file():
        return f"{key}: {path} does not exist; give a .safetensors (or .pt/.pth/.bin) weights file"
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open  # lazy: a few commands read weights files

            with safe_open(str(file), framework="pt"):
                pass
        elif zipfile.is_zipfile(file):  # torch.save's format; an older pickle file is read in full later
            zipfile.ZipFile(file).close()
        elif file.read_bytes()[:2] == b"PK":
            raise ValueError("a zip archive without its central directory")
    except Exception as e:
        detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
        return f"{key}: cannot read {path}: the file is truncated or damaged ({detail}); download or export it again"
    return None


def read_weights(path: str | Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file someone gives tk: ``.safetensors``, else a torch state dict
    (``.pt``/``.pth``/``.bin``, read with ``weights_only=True``).

    Raises:
        TkError: one line naming ``key`` and the file: missing, or truncated/damaged.
    """
    problem = weights_file_problem(path, key)
    if problem:
        raise TkError(problem)
    file = Path(path).expanduser()
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file  # lazy: a few commands read weights files

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch raise several kinds for a damaged file
        detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise TkError(f"{key}: cannot read {path}: the file is truncated or damaged ({detail}); download or "
                      f"export it again") from e


def state_with_norm_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with a zero ``bias`` for every LayerNorm built without one
    (``model.norm_bias: false``): formats whose LayerNorms always add a bias (GPT-2, BERT, timm's
    ViT) then compute exactly the same function."""
    sd = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and module.elementwise_affine and module.bias is None:
            sd[f"{name}.bias"] = torch.zeros_like(module.weight)
    return sd


def tk_metadata(task: str, step: int | None, **extra: str) -> dict[str, str]:
    """The safetensors header metadata of a file tk writes: ``format`` (``pt``, as transformers
    and timm expect), the tk version, the task and the step of the weights."""
    import tk  # the package version (tk/__init__.py)

    return {"format": "pt", "tk_version": tk.__version__, "tk_task": task,
            "tk_step": "" if step is None else str(step), **extra}


def export_safetensors(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write weights to a ``.safetensors`` file (atomically).

    A model with LoRA adapters is written merged (``tk.core.nn.lora.merged_state_dict``):
    the file fits the same model built without ``model.lora``.

    safetensors refuses tensors that share memory (tied embeddings, views), so every
    tensor whose storage was already seen, or that covers only part of its storage,
    is cloned; non-tensor entries are skipped.
    """
    sd = merged_state_dict(model_or_state_dict) if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    seen: set[tuple[str, int]] = set()
    tensors = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        partial = storage.nbytes() != t.numel() * t.element_size()
        tensors[name] = t.clone().contiguous() if key in seen or partial or not t.is_contiguous() else t
        seen.add(key)
    blob = st_save(tensors, metadata=metadata)
    atomic_write(Path(path), lambda f: f.write(blob))


def average_checkpoints(paths: Iterable[str | Path], key: str | None = "model") -> dict[str, torch.Tensor]:
    """Average the model weights of several checkpoints (e.g. the last K), as the
    Transformer paper does; integer/bool buffers (counters) come from the last one.

    Args:
        paths: checkpoint files written by :func:`save_checkpoint`, oldest first.
        key: where the model state lives in each checkpoint (None: the checkpoint
            itself is the state dict).

    Returns:
        The averaged state dict (floating tensors keep their dtype; summed in float64).

    Raises:
        TkError: no paths, a missing ``key``, or checkpoints with different keys/shapes.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise TkError("average_checkpoints needs at least one checkpoint path")
    total: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    for i, path in enumerate(paths):
        ckpt = load_checkpoint(path)
        if key is not None and key not in ckpt:
            raise TkError(f"checkpoint {str(path)!r} has no {key!r} entry (keys: {sorted(ckpt)})")
        sd = ckpt[key] if key is not None else ckpt
        if i and (set(sd) != set(total) or any(sd[k].shape != total[k].shape for k in sd)):
            raise TkError(f"checkpoint {str(path)!r} has other keys or shapes than {str(paths[0])!r}; average runs of one model only")
        for k, v in sd.items():
            total[k] = total[k] + v.double() if i else v.double()
        last = sd
    return {
        k: (total[k] / len(paths)).to(v.dtype) if v.is_floating_point() else v.clone()
        for k, v in last.items()
    }
