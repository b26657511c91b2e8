"""The ``model:`` section and its builder: the core ViT, or any timm model by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from tk.core.errors import TkError
from tk.core.nn.config import ViTConfig
from tk.core.nn.vit import VisionTransformer
from tk.plugins.image_classification.pretrained import apply_freeze, check_pretrained


@dataclass
class ModelConfig(ViTConfig):
    """The recipe's ``model:`` section: core's :class:`ViTConfig` (every field a key) plus the
    backbone choice; toy-sized defaults. The input size is ``data.img_size``."""

    patch_size: int = 4  # ViT patch side in pixels; must divide data.img_size
    dim: int = 64  # ViT width D
    depth: int = 4  # number of ViT blocks
    num_heads: int = 4  # attention heads H; dim must be divisible by it
    mlp_ratio: float = 2.0  # MLP hidden width / dim
    arch: Literal["vit"] = "vit"  # tk backbone to build (ignored when `timm` is set)
    timm: str | None = None  # build this timm model instead, e.g. "resnet18" (random init)
    pretrained: bool = False  # model.timm: start from timm's pretrained weights (hub; offline: pretrained_from a file)
    pretrained_from: str | None = None  # start from: a tk ViT run dir or .pt checkpoint (arch vit), a timm weights file (.safetensors/.pth), or a timm ViT name (arch vit)
    freeze: str = "none"  # none | backbone (train the head only) | all_but_last_N (N last blocks + head train)

    def check(self, prefix: str = "model") -> list[str]:
        """The ViT's problems (none when a timm model is built instead) and the fine-tuning keys'."""
        problems = check_pretrained(self.pretrained, self.timm, self.freeze, self.pretrained_from, self.stem)
        if self.timm is None:
            return super().check(prefix) + problems
        return problems + (self.lora.check(f"{prefix}.lora") if self.lora is not None else [])


def check_model(cfg: ModelConfig, img_size: int) -> list[str]:
    """Cross-section problems of the ``model:`` section (its own rules are ``cfg.check()``)."""
    if cfg.timm is None and (cfg.patch_size < 1 or img_size % cfg.patch_size):
        return [f"model.patch_size ({cfg.patch_size}) must divide data.img_size ({img_size})"]
    return []


def build_classifier(cfg: ModelConfig, num_classes: int, img_size: int) -> nn.Module:
    """The classifier ``cfg`` describes, mapping (B, 3, img_size, img_size) to (B, num_classes).

    Raises:
        TkError: an unknown timm model name (with close matches).
    """
    if cfg.timm is not None:
        model = _build_timm(cfg.timm, num_classes, img_size)
    else:
        model = VisionTransformer(cfg, img_size=img_size, num_classes=num_classes)
    apply_freeze(model, cfg.freeze)
    return model


def _build_timm(name: str, num_classes: int, img_size: int, **extra: Any) -> nn.Module:
    import timm  # lazy: only recipes naming a timm model pay for importing it

    if not timm.is_model(name):
        close = timm.list_models(f"*{name}*")[:8]
        hint = f"; close matches: {', '.join(close)}" if close else "; see timm.list_models()"
        raise TkError(f"model.timm {name!r} is not a timm model{hint}")
    kwargs = {"num_classes": num_classes, "pretrained": False, **extra}
    try:  # transformers need the input size for their position embeddings; CNNs reject it
        model = timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError:
        model = timm.create_model(name, **kwargs)
    if hasattr(model, "set_distilled_training"):  # timm DeiT: return both heads in training, like tk's ViT
        model.set_distilled_training(True)
    return model


def is_distilled(model: nn.Module) -> bool:
    """Whether ``model`` (or the module inside a DDP / compile wrapper) has a DeiT ``head_dist``."""
    return isinstance(getattr(unwrap(model), "head_dist", None), nn.Module)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``torch.compile`` / DistributedDataParallel wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def both_heads(model: nn.Module, images: Tensor) -> tuple[Tensor, Tensor]:
    """``(cls_logits, dist_logits)``, each (B, C), of a distilled tk or timm DeiT model in
    any mode (in eval mode ``model(images)`` returns only their average)."""
    inner = unwrap(model)
    tokens = inner.forward_features(images)  # (B, 2 + N, D), normed
    return inner.head(tokens[:, 0]), inner.head_dist(tokens[:, 1])
