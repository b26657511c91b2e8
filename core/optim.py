"""Optimisers with timm-style parameter groups: no decay on norms/biases/embeddings,
optional layer-wise learning-rate decay for fine-tuning.

Layer-wise decay: BEiT (https://arxiv.org/abs/2106.08254), ELECTRA (https://arxiv.org/abs/2003.10555).
Decoupled weight decay: AdamW (https://arxiv.org/abs/1711.05101).
Adafactor (https://arxiv.org/abs/1804.04235) is torch's; Lion (https://arxiv.org/abs/2302.06675) timm's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import nn

from tk.core.errors import TkError

__all__ = ["OPTIMIZERS", "OptimConfig", "build_optimizer", "param_groups"]

OPTIMIZERS = ("adamw", "sgd", "adafactor", "lion")


@dataclass
class OptimConfig:
    """The recipe's ``optim:`` section."""

    name: Literal["adamw", "sgd", "adafactor", "lion"] = "adamw"  # adamw | sgd | adafactor (torch's) | lion (timm's)
    lr: float = 1e-3  # peak learning rate (the schedule multiplies it); Noam: the lr factor
    weight_decay: float = 0.05  # decay coefficient, applied to weight matrices only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW/Lion (beta1, beta2); Lion's paper: [0.9, 0.99]
    eps: float = 1e-8  # AdamW denominator epsilon
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = False  # SGD: use Nesterov momentum
    layer_decay: float | None = None  # layer-wise lr decay in (0, 1]: group lr *= decay**(L - layer_id)
    decay_norm_and_bias: bool = False  # also decay norms, biases, embeddings (off: timm's convention)
    decay_embeddings: bool = False  # also decay embedding tables, not norms or biases (nanoGPT: every 2-D tensor)
    fused: bool | None = None  # torch's fused kernel (one kernel for all parameters; CUDA, and CPU in torch >= 2.4); None: torch's default
    foreach: bool | None = None  # torch's multi-tensor (foreach) implementation; None: torch's default

    def check(self) -> list[str]:
        """Range checks; one message per broken rule, naming the ``optim.*`` key."""
        errors = []
        if not self.lr > 0:
            errors.append(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            errors.append(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            errors.append(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            errors.append(f"optim.eps must be > 0, got {self.eps}")
        if not 0.0 <= self.momentum < 1.0:
            errors.append(f"optim.momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            errors.append("optim.nesterov needs optim.momentum > 0, got 0")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            errors.append(f"optim.layer_decay must be in (0, 1] or null, got {self.layer_decay}")
        if self.fused and self.foreach:
            errors.append("optim.fused and optim.foreach: choose one of them (set the other to null)")
        if self.name not in OPTIMIZERS:
            errors.append(f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        elif self.fused and self.name in ("adafactor", "lion"):
            errors.append(f"optim.fused: {self.name} has no fused kernel; set optim.fused=null "
                          "(optim.foreach=true is its multi-tensor kernel)")
        return errors


def _no_decay_ids(model: nn.Module, embeddings: bool = True) -> set[int]:
    """ids of parameters that get no weight decay: ndim <= 1 (norms, biases, scalars),
    nn.Embedding weights (unless ``embeddings`` is false) and the names each (sub)module lists in
    ``no_weight_decay()``."""
    skip: set[int] = set()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        if p.ndim <= 1:
            skip.add(id(p))
    for prefix, module in model.named_modules():
        if embeddings and isinstance(module, nn.Embedding):
            skip.add(id(module.weight))
        hook = getattr(module, "no_weight_decay", None)
        if callable(hook):
            # timm convention: names relative to the module; an entry may also name a
            # submodule or parameter prefix (e.g. "pos_embed", "cls_token").
            for entry in hook():
                full = f"{prefix}.{entry}" if prefix else entry
                for name, p in params.items():
                    if name == full or name.startswith(full + "."):
                        skip.add(id(p))
    return skip


def _layer_ids(
    model: nn.Module,
    names: list[str],
    layer_id_fn: Callable[[str], int] | None,
    num_layers: int | None,
) -> tuple[dict[str, int], int]:
    """Layer id per parameter name, and the number of layers L (the head's id)."""
    fn = layer_id_fn or getattr(model, "layer_id", None)
    if num_layers is None and callable(getattr(model, "num_layers", None)):
        num_layers = model.num_layers()
    if fn is None or num_layers is None:
        raise ValueError(
            "optim.layer_decay is set, but the model provides no layer ids: give the model "
            "methods layer_id(param_name) -> int and num_layers() -> int, or pass "
            "build_optimizer(..., layer_id_fn=..., num_layers=...); or set optim.layer_decay: null"
        )
    ids = {}
    for name in names:
        lid = int(fn(name))
        if not 0 <= lid <= num_layers:
            raise ValueError(f"layer_id({name!r}) = {lid} is outside [0, num_layers={num_layers}]")
        ids[name] = lid
    return ids, num_layers


def param_groups(
    model: nn.Module,
    cfg: OptimConfig,
    layer_id_fn: Callable[[str], int] | None = None,
    num_layers: int | None = None,
    lr_scale: Callable[[str], float] | None = None,
) -> list[dict]:
    """Parameter groups for ``model``: (decay / no decay) x (layer-wise lr scale) x
    (the caller's own lr scale).

    Each group holds ``params``, ``param_names``, ``weight_decay``, ``lr_scale``
    (1.0 without layer decay or ``lr_scale``) and ``lr = cfg.lr * lr_scale``. Frozen
    parameters (``requires_grad=False``) are left out; a parameter shared by several
    modules appears once.

    Args:
        model: the model.
        cfg: the ``optim:`` section.
        layer_id_fn / num_layers: see :func:`build_optimizer`.
        lr_scale: parameter name -> lr multiplier, e.g. ``lambda n: 0.1 if
            n.startswith("backbone.") else 1.0`` to fine-tune a pretrained backbone
            more gently than a new head; combines with ``layer_decay`` by product.

    Raises:
        ValueError: no trainable parameters, or ``layer_decay`` without layer ids.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to optimise")
    skip = set() if cfg.decay_norm_and_bias else _no_decay_ids(model, embeddings=not cfg.decay_embeddings)
    if cfg.layer_decay is not None:
        ids, n_layers = _layer_ids(model, [n for n, _ in named], layer_id_fn, num_layers)
    groups: dict[tuple[bool, int], dict] = {}
    for name, p in named:
        decay = id(p) not in skip
        lid = ids[name] if cfg.layer_decay is not None else 0
        scale = cfg.layer_decay ** (n_layers - lid) if cfg.layer_decay is not None else 1.0
        extra = float(lr_scale(name)) if lr_scale is not None else 1.0
        scale *= extra
        key = (decay, lid, extra)
        if key not in groups:
            groups[key] = {
                "params": [],
                "param_names": [],
                "weight_decay": cfg.weight_decay if decay else 0.0,
                "lr_scale": scale,
                "lr": cfg.lr * scale,
            }
        groups[key]["params"].append(p)
        groups[key]["param_names"].append(name)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[1], k[2], not k[0]))]


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    layer_id_fn: Callable[[str], int] | None = None,
    num_layers: int | None = None,
    groups: list[dict] | None = None,
) -> torch.optim.Optimizer:
    """The optimiser named by ``cfg`` over ``groups`` (default: :func:`param_groups` of ``model``).

    Group learning rates already include ``lr_scale`` (``lr = cfg.lr * lr_scale``), so a
    scheduler that multiplies each group's initial lr (``tk.core.schedule``) keeps the
    layer-wise ratios.

    Args:
        model: the model; parameters with ``requires_grad=False`` are skipped.
        cfg: the ``optim:`` section.
        layer_id_fn: maps a parameter name to its layer id in ``[0, num_layers]``
            (0 = embeddings, ``num_layers`` = head, which keeps the full lr); defaults to
            ``model.layer_id``. Only used when ``cfg.layer_decay`` is set.
        num_layers: defaults to ``model.num_layers()``.
        groups: parameter groups, e.g. from ``Task.param_groups``; each needs ``params``
            and ``lr`` (and may set ``weight_decay``).

    Raises:
        ValueError: a config value out of range (message names the ``optim.*`` key).
    """
    errors = cfg.check()
    if errors:
        raise ValueError("; ".join(errors))
    if groups is None:
        groups = param_groups(model, cfg, layer_id_fn, num_layers)
    kernels = {"fused": cfg.fused, "foreach": cfg.foreach}
    try:
        if cfg.name == "adamw":
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernels)
        if cfg.name == "sgd":
            return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kernels)
        if cfg.name == "adafactor":  # torch's defaults for its own constants (beta2 decay, eps pair, clipping d)
            return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=cfg.foreach)
        from timm.optim import Lion  # lazy, as everywhere in core: timm's import pulls in all its models

        return Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas), foreach=cfg.foreach)
    except RuntimeError as e:  # e.g. "`fused=True` requires all the params to be floating point Tensors of
        # supported devices" (the device or dtype has no fused kernel in this torch)
        if not cfg.fused:
            raise
        first = (str(e).splitlines() or [""])[0]
        raise TkError(f"optim.fused: torch {torch.__version__} has no fused {cfg.name} kernel for these "
                         f"parameters ({first}); set optim.fused=null") from None

