"""Fine-tuning from timm pretrained weights: loading (hub or file), freezing, layer ids.

``model.timm`` models load through timm itself (``pretrained_cfg_overlay=dict(file=...)``
for a local file), so timm drops the old classifier and resamples position embeddings
for another ``img_size``; the tk ViT (``arch: vit``) loads a timm ViT state dict with
:func:`tk.core.nn.vit.load_timm_vit`. Either way the head (and ``head_dist``) stay freshly
initialised for the task's classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.core.engine.inference import SourceRun, adopt_shape, open_source
from tk.core.errors import TkError
from tk.core.exchange.export import read_weights as read_weights_file
from tk.core.exchange.export import weights_file_problem
from tk.core.nn.vit import VisionTransformer, load_timm_vit

log = logging.getLogger(__name__)

HEADS = ("head.", "head_dist.", "fc.", "classifier.")  # classifier prefixes (ViT, ResNet, others): re-initialised


WEIGHT_SUFFIXES = (".safetensors", ".pth", ".bin")  # model.pretrained_from: timm weights (.pt: a tk checkpoint)


def source_kind(spec: str | None) -> str | None:
    """What ``model.pretrained_from`` names: "run" (a folder: a tk run dir; a ``.pt`` file: a tk
    checkpoint), "file" (timm weights), "name" (a timm model whose published weights to fetch)."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    if path.is_dir() or path.suffix == ".pt":
        return "run"
    if path.is_file() or path.suffix in WEIGHT_SUFFIXES or "/" in spec:
        return "file"
    return "name"


def weights_problems(spec: str | None) -> list[str]:
    """A ``model.pretrained_from`` weights file that cannot be read (missing, truncated), found cheaply."""
    problem = weights_file_problem(spec, "model.pretrained_from") if source_kind(spec) == "file" else None
    return [problem] if problem else []


# model.* keys a tk ViT run's config.yaml sets for a run started from it
VIT_SHAPE_KEYS = ("dim", "depth", "num_heads", "num_kv_heads", "mlp_ratio", "hidden_dim", "activation", "norm",
                  "norm_eps", "final_norm", "bias", "norm_bias", "patch_size", "stem", "pooling", "distilled")


def open_vit_run(m: Any, img_size: int, given: Collection[str] | None = None) -> tuple[SourceRun, Any] | None:
    """``model.pretrained_from`` as a tk ViT run (None where it names a file or a timm model):
    the run and the ``model:`` section with the run's shape (a recipe key that disagrees is an error).

    Raises:
        TkError: not a tk run, a run of another task or of a timm model, no checkpoint, or a
            patch size that does not divide ``data.img_size``.
    """
    if source_kind(m.pretrained_from) != "run":
        return None
    source = open_source(m.pretrained_from, "image_classification", ("image_classification",))
    if source is None:
        raise TkError(f"model.pretrained_from: {m.pretrained_from} is a folder without config.yaml; give a tk ViT "
                      f"run dir, a .pt checkpoint, a timm weights file or a timm ViT name")
    timm_name = source.section("model").get("timm")
    if timm_name:
        raise TkError(f"model.pretrained_from: {m.pretrained_from} is a run of timm {timm_name!r}; starting from a "
                      f"timm run is not supported yet: give a tk ViT (arch: vit) run, or a timm weights file")
    # a run from before the `stem` key had the patch stem
    adopted = adopt_shape(m, {"stem": "patch", **source.section("model")}, VIT_SHAPE_KEYS, given)
    if img_size % adopted.patch_size:
        raise TkError(f"data.img_size ({img_size}) must be a multiple of the model.pretrained_from run's "
                      f"model.patch_size ({adopted.patch_size})")
    return source, adopted


def check_pretrained(pretrained: bool, timm_name: str | None, freeze: str,
                     pretrained_from: str | None = None, stem: str = "patch") -> list[str]:
    """Problems of the fine-tuning keys of ``model:``."""
    problems = []
    kind = source_kind(pretrained_from)
    if stem != "patch" and timm_name is None and kind in ("name", "file"):
        problems.append(f"model.stem ({stem!r}): timm ViT weights ({pretrained_from}) have a patch stem; "
                        f"remove model.stem (or set it to 'patch') to start from them")
    if pretrained and timm_name is None and pretrained_from is None:
        problems.append("model.pretrained: the tk ViT (arch: vit) needs the weights to load: set model.pretrained_from "
                        "(a timm ViT name such as vit_tiny_patch16_224, a weights file, or a tk ViT run)")
    if timm_name is not None and kind in ("name", "run"):
        problems.append(f"model.pretrained_from ({pretrained_from}) with model.timm set must be a weights file of that "
                        f"model; model.pretrained: true loads its published weights, a tk run needs arch: vit")
    if freeze not in ("none", "backbone") and not (freeze.startswith("all_but_last_") and
                                                   freeze[len("all_but_last_"):].isdigit()):
        problems.append(f"model.freeze ({freeze!r}) must be none, backbone or all_but_last_N (N blocks train)")
    return problems


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` or ``.pth``/``.bin`` file (``state_dict``/``model`` wrappers
    unwrapped).

    Raises:
        TkError: a missing or unreadable file.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise TkError(f"model.pretrained_from: {path} does not exist; give a tk ViT run dir or .pt checkpoint, "
                      f"a .safetensors/.pth file of timm weights, or a timm ViT name")
    state = read_weights_file(file, "model.pretrained_from")
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    return state


def _is_head(name: str) -> bool:
    return name.startswith(HEADS)


def load_pretrained_vit(model: VisionTransformer, path: str | None, timm_name: str | None = None,
                        weights: dict[str, torch.Tensor] | None = None) -> None:
    """timm ViT weights from ``path`` (or, without a path, timm's published weights of
    ``timm_name`` from the hub, or the state dict ``weights`` of a tk ViT run) into the tk ViT;
    heads keep their fresh initialisation, position embeddings (and the patch kernel) are
    resampled to the model's grid.

    Raises:
        TkError: the file is missing or does not fit, naming the file and the first bad tensor;
            the hub cannot be reached (suggesting ``model.pretrained_from``).
    """
    if weights is None:
        weights = read_weights(path) if path is not None else _hub_state_dict(timm_name)
    state = {k: v for k, v in weights.items() if not _is_head(k)}
    own = model.state_dict()
    state.update({k: v for k, v in own.items() if _is_head(k)})
    try:
        load_timm_vit(model, state)
    except ValueError as e:
        raise TkError(f"model.pretrained_from: {path or timm_name} does not fit the model: {e} (the weights: "
                      f"{describe_vit_weights(weights)}; the model: {describe_vit_weights(own)})") from e
    heads = sorted({k.split(".")[0] for k in own if _is_head(k)})
    theirs = weights.get("head.weight")
    loaded = sum(not _is_head(k) for k in weights)
    log.info("model.pretrained_from: %d tensors from %s; new: %s (%d classes%s)%s", loaded,
             path or timm_name, ", ".join(heads), model.num_classes,
             f", the source's head had {theirs.shape[0]}" if theirs is not None else "",
             _resampled(weights.get("pos_embed"), own.get("pos_embed"), model))


def describe_vit_weights(state: dict[str, torch.Tensor]) -> str:
    """``dim 192, depth 12, patch 16, 197 positions``: what a ViT state dict's tensors say."""
    proj, pos = state.get("patch_embed.proj.weight"), state.get("pos_embed")
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    parts = [f"dim {proj.shape[0]}" if proj is not None else None, f"depth {depth}",
             f"patch {proj.shape[-1]}" if proj is not None and proj.dim() == 4 else None,
             f"{pos.shape[1]} positions" if pos is not None else None]
    return ", ".join(p for p in parts if p)


def _resampled(theirs: torch.Tensor | None, own: torch.Tensor | None, model: nn.Module) -> str:
    if theirs is None or own is None or theirs.shape == own.shape:
        return ""
    return (f"; position table resampled from {theirs.shape[1]} to {own.shape[1]} positions "
            f"({'x'.join(map(str, model.patch_embed.grid))} patches)")


def _hub_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The state dict of timm's pretrained ``name`` (downloaded by timm from the hub)."""
    import timm  # lazy: only models that load timm weights pay for it

    if not timm.is_model(name):
        raise TkError(f"model.pretrained_from {name!r} is not a timm model; see timm.list_models('vit_*')")
    try:
        return timm.create_model(name, pretrained=True).state_dict()
    except Exception as e:  # hub offline or unknown weights: many exception kinds
        raise TkError(f"model.pretrained: cannot fetch timm's pretrained weights for {name!r} ({type(e).__name__}: "
                      f"{e}); offline, download them elsewhere and set model.pretrained_from: PATH (the weights file)") from e


def load_pretrained_timm(model: nn.Module, name: str, num_classes: int, img_size: int, path: str | None) -> None:
    """Weights of timm's ``name`` (hub, or ``path``) into ``model`` (built by timm with the same
    name, ``num_classes`` and ``img_size``): timm's own loader resets the classifier and
    resamples position embeddings.

    Raises:
        TkError: the hub cannot be reached (use ``model.pretrained_from``), or the file is
            missing or does not fit (naming the file and the first tensor it lacks or mismatches).
    """
    import timm  # lazy: only timm models pay for it

    kwargs: dict[str, Any] = {"pretrained": True, "num_classes": num_classes}
    if path is not None:
        file_state = read_weights(path)  # fails early, naming the file
        kwargs["pretrained_cfg_overlay"] = {"file": str(Path(path).expanduser())}
    try:
        try:
            source = timm.create_model(name, img_size=img_size, **kwargs)
        except TypeError:  # CNNs take no img_size
            source = timm.create_model(name, **kwargs)
    except RuntimeError as e:  # load_state_dict: size mismatch / missing keys, each named
        raise TkError(f"model.pretrained_from: {path} does not fit timm {name!r}: {str(e).splitlines()[1:2] or e}") from e
    except Exception as e:  # hub offline or unknown weights: many exception kinds
        if path is not None:
            raise TkError(f"model.pretrained_from: cannot load {path} into timm {name!r}: {e}") from e
        raise TkError(f"model.pretrained: cannot fetch timm's pretrained weights for {name!r} ({type(e).__name__}: "
                      f"{e}); offline, download them elsewhere and set model.pretrained_from: PATH (the weights file)") from e
    if path is not None:  # timm loads non-strictly when it drops the classifier: check the backbone
        lacking = [k for k in source.state_dict() if not _is_head(k) and k not in file_state]
        if lacking:
            raise TkError(f"model.pretrained_from: {path} has no tensor {lacking[0]!r} that timm {name!r} needs "
                          f"({len(lacking)} missing); give weights of the same architecture")
    model.load_state_dict(source.state_dict())


def apply_freeze(model: nn.Module, freeze: str) -> None:
    """``backbone``: only the classifier head(s) train; ``all_but_last_N``: the last N blocks,
    the final norm and the head(s) train (needs a ViT-like ``blocks``); ``none``: all train."""
    if freeze == "none":
        return
    train_blocks = 0 if freeze == "backbone" else int(freeze[len("all_but_last_"):])
    blocks = getattr(model, "blocks", None)
    if freeze != "backbone" and blocks is None:
        raise TkError(f"model.freeze {freeze!r} needs a model with transformer blocks; use backbone or none")
    depth = len(blocks) if blocks is not None else 0
    for name, p in model.named_parameters():
        if _is_head(name):
            continue
        keep = freeze != "backbone" and (
            (name.startswith("blocks.") and int(name.split(".")[1]) >= depth - train_blocks)
            or name.startswith(("norm.", "fc_norm.")))
        p.requires_grad_(keep)


def vit_layer_id_fn(model: nn.Module) -> tuple[Callable[[str], int], int] | None:
    """Layer ids for ``optim.layer_decay`` of a timm ViT (tk's ViT has its own): same names,
    same rule as :meth:`VisionTransformer.layer_id`; None for a model without ``blocks``."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return None
    depth = len(blocks)

    def layer_id(name: str) -> int:
        if name.startswith(("patch_embed.", "cls_token", "dist_token", "pos_embed", "reg_token")):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return depth + 1

    return layer_id, depth + 1
