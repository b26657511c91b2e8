"""Where and how a run computes: device choice, machine checks before a run starts,
seeding and deterministic kernels, activation checkpointing."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from tk.core.config import ConfigError
from tk.core.errors import TkError
from tk.core.run.loggers import missing_logger_packages
from tk.core.training.precision import check_precision

__all__ = ["resolve_device", "preflight", "check_logger_packages", "seed_everything", "enable_grad_checkpointing", "move_to_device"]


def resolve_device(name: str) -> torch.device:
    """``train.device`` -> a torch device ("auto" picks CUDA when available).

    Raises:
        TkError: not a device name, a device type tk does not train on, or a device
            this machine lacks (CUDA without a GPU, ``cuda:N`` past the last GPU, MPS).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise TkError(f"train.device: {name!r} is not a device; use auto, cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda", "mps"):
        raise TkError(f"train.device: {name!r} ({device.type}) is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TkError(f"train.device: {name!r} requested but CUDA is not available; use train.device=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise TkError(f"train.device: {name!r} requested but this machine has {torch.cuda.device_count()} "
                      f"GPU(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise TkError(f"train.device: {name!r} requested but MPS is not available; use train.device=cpu")
    return device


def check_logger_packages(cfg) -> None:
    """``train.loggers`` whose package this machine lacks: one ConfigError with the install lines."""
    missing = missing_logger_packages(cfg.train.loggers)
    if missing:
        raise ConfigError(cfg.source, missing)


def preflight(cfg) -> torch.device:
    """Checks that need the machine (device, precision support, the loggers' packages),
    run by ``tk validate`` and before a run directory is created.

    Raises:
        TkError: see :func:`resolve_device` and :class:`~tk.core.training.precision.Precision`;
            a logger whose package is missing (with its ``pip install`` line).
    """
    check_logger_packages(cfg)
    device = resolve_device(cfg.train.device)
    problem = check_precision(cfg.train.precision, device)
    if problem:
        raise TkError(problem)
    return device


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch; optionally force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def _checkpointable(module: nn.Module) -> list[nn.Module]:
    """The outermost modules with ``set_grad_checkpointing``: the model itself, or the core
    stacks / timm backbones a task's model wraps."""
    if callable(getattr(module, "set_grad_checkpointing", None)):
        return [module]
    return [found for child in module.children() for found in _checkpointable(child)]


def enable_grad_checkpointing(model: nn.Module) -> None:
    """``train.grad_checkpointing``: recompute block activations in backward, in the model or,
    when it has no ``set_grad_checkpointing`` itself, in every submodule that has one.

    Raises:
        TkError: nothing in the model has ``set_grad_checkpointing`` (core stacks, the core
            ViT and timm models have it).
    """
    modules = _checkpointable(model)
    if not modules:
        raise TkError(f"train.grad_checkpointing: {type(model).__name__} has no set_grad_checkpointing(enable) "
                      f"method, nor any of its submodules (core Transformer stacks, the core ViT and timm models "
                      f"have one); add it to the model or set train.grad_checkpointing=false")
    for module in modules:
        module.set_grad_checkpointing(True)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Recursively move the tensors of a batch (dicts, lists, tuples) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch
