"""``tk export --format timm``: a ViT run as weights ``timm.create_model`` loads.

The core :class:`VisionTransformer` already uses timm's parameter names (the inverse of
:func:`tk.core.nn.vit.convert_timm_vit_state_dict`): only mean pooling renames ``norm.*`` to
timm's ``fc_norm.*``. The shape becomes keyword arguments on a timm model name, e.g.::

    timm.create_model("vit_base_patch16_224", pretrained=True,
                      pretrained_cfg_overlay=dict(file="model.safetensors", num_classes=10),
                      num_classes=10, img_size=32, patch_size=8, embed_dim=96, depth=4, ...)

(``num_classes`` also goes into the overlay: timm drops a classifier whose size differs from
its pretrained config's). A run of a timm model (``model.timm``) exports its own state dict.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from tk.core.errors import TkError
from tk.core.exchange.export import state_with_norm_biases
from tk.core.nn.vit import VisionTransformer

__all__ = ["timm_export", "timm_load_code", "timm_hub_config", "timm_crop_pct"]

_TIMM_NORM_EPS = 1e-6  # timm's ViT LayerNorm epsilon (its norm_layer default)


def _refuse(key: str, value: Any, need: str) -> TkError:
    return TkError(f"--format timm: {key}={value!r} has no timm VisionTransformer counterpart ({need}); "
                   f"export --format safetensors, torch-export or onnx instead")


def _vit(model: VisionTransformer) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    cfg = model.cfg
    for name, allowed in (("norm", "layernorm"), ("activation", "gelu"), ("bias", True), ("stem", "patch")):
        if getattr(cfg, name) != allowed:
            raise _refuse(f"model.{name}", getattr(cfg, name), f"it needs {allowed!r}")
    if abs(cfg.norm_eps - _TIMM_NORM_EPS) > 1e-12:
        raise _refuse("model.norm_eps", cfg.norm_eps, f"its LayerNorms use {_TIMM_NORM_EPS}")
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        raise _refuse("model.num_kv_heads", cfg.num_kv_heads, "it has no grouped-query attention")
    sd = state_with_norm_biases(model)
    if cfg.pooling == "mean":  # timm applies fc_norm after "avg" pooling and has no final norm
        sd = {("fc_norm." + k[len("norm."):] if k.startswith("norm.") else k): v for k, v in sd.items()}
    proj = sd["patch_embed.proj.weight"]  # (D, C, P, P)
    kwargs = {"num_classes": model.num_classes, "img_size": model.patch_embed.grid[0] * cfg.patch_size,
              "patch_size": cfg.patch_size, "in_chans": proj.shape[1], "embed_dim": cfg.dim, "depth": cfg.depth,
              "num_heads": cfg.num_heads, "mlp_ratio": cfg.ffn_dim / cfg.dim, "qkv_bias": True,
              "global_pool": "avg" if cfg.pooling == "mean" else "token"}
    name = "deit_base_distilled_patch16_224" if cfg.distilled else "vit_base_patch16_224"
    return name, kwargs, sd


def timm_export(task: Any, model: nn.Module) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """``(timm model name, create_model kwargs, state dict)`` for a run's image classifier.

    Raises:
        TkError: not an image classifier of the core ViT or timm, or a ViT option timm lacks.
    """
    timm_name = getattr(getattr(task, "model_cfg", None), "timm", None)
    if timm_name is not None:  # already a timm model: its own names and arguments
        kwargs: dict[str, Any] = {"num_classes": model.num_classes}
        if hasattr(model, "pos_embed"):  # a transformer: built for the run's input size
            kwargs["img_size"] = task.data.img_size
        return timm_name, kwargs, model.state_dict()
    if isinstance(model, VisionTransformer):
        return _vit(model)
    article = "an" if type(model).__name__[:1] in "AEIOU" else "a"
    raise TkError(f"--format timm: task {task.name!r} has {article} {type(model).__name__}; only image classifiers "
                  f"(the core ViT or model.timm) export to timm; use --format safetensors")


def timm_load_code(name: str, kwargs: dict[str, Any], file: str = "model.safetensors") -> str:
    """The Python line that loads the exported weights with timm."""
    overlay = f"dict(file={file!r}, num_classes={kwargs['num_classes']})"
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return f"timm.create_model({name!r}, pretrained=True, pretrained_cfg_overlay={overlay}{args})"


def timm_crop_pct(img_size: int, crop_pct: float) -> float:
    """The ``crop_pct`` with which timm's eval transform resizes as tk's does: tk resizes the
    short side to ``round(img_size / crop_pct)``, timm to ``floor(img_size / crop_pct)``
    (224 / 0.9: tk 249, timm 248), so the exported value is ``img_size / round(...)``, nudged
    down by float ulps until timm's floor lands on tk's size."""
    target = int(round(img_size / crop_pct))
    exported = img_size / target
    while math.floor(img_size / exported) < target:
        exported = math.nextafter(exported, 0.0)
    return exported


def timm_hub_config(name: str, kwargs: dict[str, Any], img_size: int, data_config: dict[str, Any],
                    class_names: list[str] | None) -> dict[str, Any]:
    """The ``config.json`` timm reads from a hub repo or a ``local-dir:`` folder: the
    architecture, its arguments, and the run's input pipeline as ``pretrained_cfg`` (input
    size, mean, std, interpolation, crop_pct), so ``timm.data.resolve_data_config({},
    model=model)`` + ``create_transform`` reproduce what ``tk predict`` feeds the model."""
    pretrained_cfg = {
        "input_size": [kwargs.get("in_chans", 3), img_size, img_size], "fixed_input_size": True,
        "interpolation": data_config.get("interpolation", "bilinear"),
        "crop_pct": timm_crop_pct(img_size, data_config.get("crop_pct") or 1.0),
        "crop_mode": "center", "mean": list(data_config["mean"]), "std": list(data_config["std"]),
        "num_classes": kwargs["num_classes"],
    }
    config: dict[str, Any] = {"architecture": name, "num_classes": kwargs["num_classes"],
                              "model_args": {k: v for k, v in kwargs.items() if k != "num_classes"},
                              "pretrained_cfg": pretrained_cfg}
    if class_names:
        config["label_names"] = list(class_names)
    return config
