"""The ``model:`` section and its builder: the core ViT, or any timm model by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from tk.core.errors import TkError
from tk.core.nn.vit import VisionTransformer


@dataclass
class ModelConfig:
    """The recipe's ``model:`` section. The input size is ``data.img_size``."""

    arch: Literal["vit"] = "vit"  # tk backbone to build (ignored when `timm` is set)
    timm: str | None = None  # build this timm model instead, e.g. "resnet18" (random init)
    patch_size: int = 4  # ViT patch side in pixels; must divide data.img_size
    dim: int = 64  # ViT width D
    depth: int = 4  # number of ViT blocks
    num_heads: int = 4  # attention heads H; dim must be divisible by it
    mlp_ratio: float = 2.0  # MLP hidden width / dim
    dropout: float = 0.0  # dropout in attention projection / MLP / positions
    drop_path_rate: float = 0.0  # stochastic depth at the last block (linear from 0)
    pooling: Literal["cls", "mean"] = "cls"  # ViT pooling: class token, or mean of patch tokens


def check_model(cfg: ModelConfig, img_size: int) -> list[str]:
    """Config problems of the ``model:`` section, one message per broken rule."""
    if cfg.timm is not None:
        return []
    problems = []
    if cfg.patch_size < 1 or img_size % cfg.patch_size:
        problems.append(f"model.patch_size ({cfg.patch_size}) must divide data.img_size ({img_size})")
    if cfg.num_heads < 1 or cfg.dim % cfg.num_heads:
        problems.append(f"model.dim ({cfg.dim}) must be divisible by model.num_heads ({cfg.num_heads})")
    if cfg.depth < 1:
        problems.append(f"model.depth ({cfg.depth}) must be >= 1")
    if not 0.0 <= cfg.drop_path_rate < 1.0:
        problems.append(f"model.drop_path_rate ({cfg.drop_path_rate}) must be in [0, 1)")
    return problems


def build_classifier(cfg: ModelConfig, num_classes: int, img_size: int) -> nn.Module:
    """The classifier ``cfg`` describes, mapping (B, 3, img_size, img_size) to (B, num_classes).

    Raises:
        TkError: an unknown timm model name (with close matches).
    """
    if cfg.timm is not None:
        return _build_timm(cfg.timm, num_classes, img_size)
    return VisionTransformer(
        img_size=img_size, patch_size=cfg.patch_size, num_classes=num_classes, dim=cfg.dim,
        depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout,
        drop_path_rate=cfg.drop_path_rate, pooling=cfg.pooling,
    )


def _build_timm(name: str, num_classes: int, img_size: int) -> nn.Module:
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name}*")[:8]
        hint = f"; close matches: {', '.join(close)}" if close else "; see timm.list_models()"
        raise TkError(f"model.timm {name!r} is not a timm model{hint}")
    kwargs = {"num_classes": num_classes, "pretrained": False}
    try:  # transformers need the input size for their position embeddings; CNNs reject it
        return timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError:
        return timm.create_model(name, **kwargs)
