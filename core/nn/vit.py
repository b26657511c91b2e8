"""Vision Transformer (ViT) backbone with optional DeiT distillation token; timm-compatible names.

Papers: "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2021), https://arxiv.org/abs/2010.11929;
DeiT, "Training data-efficient image transformers & distillation through attention"
(Touvron et al., 2021), https://arxiv.org/abs/2012.12877.

Parameter names equal timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.{i}.norm1/attn.qkv/attn.proj/norm2/mlp.fc1/mlp.fc2``, ``norm``,
``head``; DeiT's ``dist_token``, ``head_dist``), so timm weights load with
:func:`load_timm_vit`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tk.core.nn.blocks import build_attention, build_mlp
from tk.core.nn.config import ViTConfig
from tk.core.nn.layers import DropPath, build_norm
from tk.core.nn.pos_embed import resample_pos_embed
from tk.core.nn.stack import drop_path_rates

# timm ViT parts without a tk counterpart: register tokens, pre-norm, attention pooling,
# patch-embed norm, layer scale, qk-norm and the extra norms inside attention/MLP.
_UNSUPPORTED_PREFIXES = ("reg_token", "norm_pre.", "attn_pool.", "patch_embed.norm.")
_UNSUPPORTED_IN_BLOCKS = (".ls1.", ".ls2.", ".q_norm.", ".k_norm.", ".attn.norm.", ".mlp.norm.")


# -- layers ---------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """Non-overlapping P x P patches -> D-dim tokens, one strided convolution (``proj``)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, dim: int) -> None:
        """Args:
            img_size: input side in pixels (square images).
            patch_size: patch side P; must divide ``img_size``.
            in_chans: input channels.
            dim: token width D.

        Raises:
            ValueError: if ``patch_size`` does not divide ``img_size``.
        """
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size ({img_size}) must be divisible by patch_size ({patch_size})")
        self.patch_size = patch_size
        self.grid = (img_size // patch_size, img_size // patch_size)
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, N, D) with N = (H / P) * (W / P), row-major patches."""
        H, W = x.shape[-2:]
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"image size {H}x{W} is not divisible by patch_size ({self.patch_size})")
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, H/P, W/P) -> (B, N, D)


class ConvStem(nn.Module):
    """The patch embedding as a few overlapping convolutions ("Early Convolutions Help
    Transformers See Better", Xiao et al., 2021, https://arxiv.org/abs/2106.14881): log2(P)
    3x3 stride-2 convolutions with BatchNorm and ReLU, widths doubling up to D, then a 1x1
    projection (``proj``) to D. The same token grid as :class:`PatchEmbed`; it trains faster
    and better on small data sets. P must be a power of two >= 2."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, dim: int) -> None:
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size ({img_size}) must be divisible by patch_size ({patch_size})")
        steps = patch_size.bit_length() - 1
        if patch_size < 2 or 2**steps != patch_size:
            raise ValueError(f"a conv stem needs a patch_size that is a power of two >= 2, got {patch_size}")
        self.patch_size = patch_size
        self.grid = (img_size // patch_size, img_size // patch_size)
        layers: list[nn.Module] = []
        width = in_chans
        for i in range(steps):
            out = max(dim // 2 ** (steps - 1 - i), 8)
            layers += [nn.Conv2d(width, out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True)]
            width = out
        self.convs = nn.Sequential(*layers)
        self.proj = nn.Conv2d(width, dim, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, N, D), N = (H / P) * (W / P), row-major."""
        H, W = x.shape[-2:]
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"image size {H}x{W} is not divisible by patch_size ({self.patch_size})")
        return self.proj(self.convs(x)).flatten(2).transpose(1, 2)


class Block(nn.Module):
    """Pre-norm Transformer encoder block with timm's names: x + attn(norm1(x)), then
    x + mlp(norm2(x)); options (heads, FFN, activation, norm, bias, dropouts) from ``cfg``."""

    def __init__(self, cfg: ViTConfig, *, drop_path: float = 0.0) -> None:
        """Args:
            cfg: the block's options. drop_path: stochastic depth of both residual branches.
        """
        super().__init__()
        self.norm1 = build_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_bias)
        self.attn = build_attention(cfg)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = build_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_bias)
        self.mlp = build_mlp(cfg)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


# -- model ----------------------------------------------------------------------------
class VisionTransformer(nn.Module):
    """ViT classifier: patch embedding, prefix token(s), learned positions, encoder, head.

    With ``distilled=True`` (DeiT) a distillation token and ``head_dist`` are added; the
    model then returns ``(cls_logits, dist_logits)`` in training mode and their average
    in eval mode.
    """

    def __init__(
        self, cfg: ViTConfig | None = None, *, img_size: int = 224, in_chans: int = 3, num_classes: int = 1000,
        **overrides: Any,
    ) -> None:
        """Args:
            cfg: the architecture (width, depth, heads, FFN, patch size, pooling, DeiT token,
                dropouts, drop path); default ``ViTConfig()`` (ViT-B/16).
            img_size: input side in pixels (position embeddings are built for it).
            in_chans: input channels.
            num_classes: classes C of the head; 0 = no head (returns pooled (B, D) features).
            **overrides: ``ViTConfig`` fields replacing those of ``cfg``, e.g.
                ``VisionTransformer(img_size=32, patch_size=4, dim=192, depth=12, num_heads=3)``.

        Raises:
            ValueError: on any ``cfg.check()`` problem or an image size the patch does not divide.
            TypeError: on an override that is not a ``ViTConfig`` field.
        """
        super().__init__()
        cfg = dataclasses.replace(cfg or ViTConfig(), **overrides)
        cfg.validate()
        self.cfg = cfg
        dim = cfg.dim
        self.num_classes, self.dim, self.pooling, self.distilled = num_classes, dim, cfg.pooling, cfg.distilled
        self.num_prefix_tokens = 2 if cfg.distilled else 1
        self.grad_checkpointing = False

        stem = ConvStem if cfg.stem == "conv" else PatchEmbed
        self.patch_embed = stem(img_size, cfg.patch_size, in_chans, dim)
        num_patches = self.patch_embed.grid[0] * self.patch_embed.grid[1]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if cfg.distilled else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + num_patches, dim))
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*[Block(cfg, drop_path=p) for p in drop_path_rates(cfg.drop_path_rate, cfg.depth)])
        self.norm = build_norm(cfg.norm, dim, cfg.norm_eps, cfg.norm_bias)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        if cfg.distilled:
            self.head_dist = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm/DeiT initialisation: truncated normal (std 0.02) for tokens, positions
        and linear weights; zero biases; LayerNorm at identity."""
        for p in (self.cls_token, self.dist_token, self.pos_embed):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:  # model.norm_bias: false
                    nn.init.zeros_(m.bias)

    # -- engine hooks ------------------------------------------------------------------
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in backward instead of storing them."""
        self.grad_checkpointing = enable

    def num_layers(self) -> int:
        """Layer ids for ``optim.layer_decay`` run 0 .. depth + 1 (timm/BEiT)."""
        return len(self.blocks) + 1

    def layer_id(self, name: str) -> int:
        """0 for the patch embedding, tokens and positions; block i -> i + 1; the final norm
        and the heads -> ``num_layers()``."""
        if name.startswith(("patch_embed.", "cls_token", "dist_token", "pos_embed")):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return self.num_layers()

    def no_weight_decay(self) -> set[str]:
        """Parameters the optimiser should not decay (timm convention)."""
        return {"pos_embed", "cls_token", "dist_token"}

    def set_img_size(self, img_size: int) -> None:
        """Rebuild for square inputs of ``img_size`` pixels: the position embeddings are
        resampled (bicubic) to the new patch grid; prefix-token positions are kept.

        Raises:
            ValueError: if the patch size does not divide ``img_size``.
        """
        patch = self.patch_embed.patch_size
        if img_size % patch != 0:
            raise ValueError(f"img_size ({img_size}) must be divisible by patch_size ({patch})")
        new_grid = (img_size // patch, img_size // patch)
        with torch.no_grad():
            resampled = resample_pos_embed(self.pos_embed.data, new_grid, self.patch_embed.grid, self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(resampled)
        self.patch_embed.grid = new_grid

    # -- forward -----------------------------------------------------------------------
    def _position(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """Prepend prefix tokens to patch tokens (B, N, D) and add positions."""
        B = x.shape[0]
        prefix = [self.cls_token.expand(B, -1, -1)]
        if self.dist_token is not None:
            prefix.append(self.dist_token.expand(B, -1, -1))
        x = torch.cat(prefix + [x], dim=1)  # (B, prefix + N, D)
        pos = self.pos_embed
        if grid != self.patch_embed.grid:  # another input size: resample on the fly
            pos = resample_pos_embed(pos, grid, self.patch_embed.grid, self.num_prefix_tokens)
        return self.pos_drop(x + pos)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, prefix + N, D) tokens (after ``norm`` for "cls" pooling)."""
        grid = (x.shape[-2] // self.patch_embed.patch_size, x.shape[-1] // self.patch_embed.patch_size)
        x = self._position(self.patch_embed(x), grid)
        for block in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.norm(x) if self.pooling == "cls" else x

    def forward_head(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """Tokens (B, prefix + N, D) -> logits (B, C) (or the DeiT pair / average)."""
        if self.pooling == "mean":
            # timm's "avg" pooling: mean over patch tokens, then the norm (its fc_norm)
            return self.head(self.norm(x[:, self.num_prefix_tokens:].mean(dim=1)))
        if not self.distilled:
            return self.head(x[:, 0])
        cls_logits, dist_logits = self.head(x[:, 0]), self.head_dist(x[:, 1])
        if self.training:
            return cls_logits, dist_logits
        return (cls_logits + dist_logits) / 2

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: (B, C, H, W) images; H and W divisible by the patch size.

        Returns:
            (B, C) logits; for a distilled model in training, (cls_logits, dist_logits).
        """
        return self.forward_head(self.forward_features(x))


# -- timm weights ----------------------------------------------------------------------
def convert_timm_vit_state_dict(timm_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A timm ``VisionTransformer`` (or DeiT distilled) state dict in this module's names.

    Name mapping (timm -> tk): every name is kept as is
    (``patch_embed.proj.*``, ``cls_token``, ``dist_token``, ``pos_embed``,
    ``blocks.{i}.norm1.*``, ``blocks.{i}.attn.qkv.*``, ``blocks.{i}.attn.proj.*``,
    ``blocks.{i}.norm2.*``, ``blocks.{i}.mlp.fc1.*``, ``blocks.{i}.mlp.fc2.*``, ``norm.*``,
    ``head.*``, ``head_dist.*``), except ``fc_norm.*`` (timm's norm after "avg" pooling)
    which becomes ``norm.*`` (tk applies ``norm`` after mean pooling).

    Raises:
        ValueError: for timm features this ViT lacks (register tokens, layer scale,
            qk-norm, attention pooling, pre-norm, ...), named by their keys.
    """
    out: dict[str, Tensor] = {}
    bad = []
    has_fc_norm = any(k.startswith("fc_norm.") for k in timm_state_dict)
    for key, value in timm_state_dict.items():
        if key.startswith(_UNSUPPORTED_PREFIXES) or any(part in key for part in _UNSUPPORTED_IN_BLOCKS):
            bad.append(key)
            continue
        if key.startswith("fc_norm."):
            key = "norm." + key[len("fc_norm."):]
        elif key.startswith("norm.") and has_fc_norm:
            bad.append(key)  # a final norm AND fc_norm: a layout the tk ViT does not have
            continue
        out[key] = value
    if bad:
        raise ValueError(f"timm checkpoint has parts the tk ViT does not support: {bad[:6]}"
                         f"{' ...' if len(bad) > 6 else ''}; use model.timm to run this model through timm")
    return out


def load_timm_vit(core_model: VisionTransformer, timm_model_or_state_dict: nn.Module | Mapping[str, Any]) -> None:
    """Copy a timm ViT's weights into ``core_model`` (in place).

    Position embeddings for another patch grid are resampled to ``core_model``'s grid, and the
    patch-embedding kernel to its patch size (FlexiViT resampling, timm's
    ``resample_patch_embed``).

    Args:
        core_model: the destination tk ViT.
        timm_model_or_state_dict: a timm model or its ``state_dict()``.

    Raises:
        ValueError: a missing or unexpected key, or a shape mismatch (naming the key and
            both shapes).
    """
    sd = timm_model_or_state_dict
    sd = convert_timm_vit_state_dict(sd.state_dict() if isinstance(sd, nn.Module) else sd)
    own = core_model.state_dict()
    if "pos_embed" in sd and sd["pos_embed"].shape != own["pos_embed"].shape:
        n_prefix = core_model.num_prefix_tokens
        n_old = sd["pos_embed"].shape[1] - n_prefix
        side = int(round(n_old ** 0.5))
        if side * side == n_old and sd["pos_embed"].shape[2] == own["pos_embed"].shape[2]:
            sd["pos_embed"] = resample_pos_embed(sd["pos_embed"], core_model.patch_embed.grid, (side, side), n_prefix)
    kernel = sd.get("patch_embed.proj.weight")
    own_kernel = own["patch_embed.proj.weight"]
    if kernel is not None and kernel.shape[:2] == own_kernel.shape[:2] and kernel.shape[2:] != own_kernel.shape[2:]:
        # another patch size: FlexiViT's pseudo-inverse resampling, as timm does when loading
        from timm.layers import resample_patch_embed  # lazy: only a patch-size change needs timm here

        sd["patch_embed.proj.weight"] = resample_patch_embed(kernel, list(own_kernel.shape[2:]))
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(f"timm ViT weights do not match the tk ViT: missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]}; build the tk ViT with the same depth, heads and tokens")
    for key, value in sd.items():
        if value.shape != own[key].shape:
            raise ValueError(f"shape mismatch for {key!r}: timm has {tuple(value.shape)}, "
                             f"the tk ViT has {tuple(own[key].shape)}")
    core_model.load_state_dict(sd)
