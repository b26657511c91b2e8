"""Transformer layers built from one :class:`TransformerConfig`: encoder layer, encoder-decoder
decoder layer and decoder-only layer, each post-norm (the paper) or pre-norm (``norm_first``).

Papers: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762;
pre-norm, "On Layer Normalization in the Transformer Architecture" (Xiong et al., 2020),
https://arxiv.org/abs/2002.04745.

Sublayer: post-norm ``x = norm(x + drop_path(f(x)))``; pre-norm ``x = x + drop_path(f(norm(x)))``.
Residual dropout (``cfg.dropout``) sits inside the sublayers (attention ``proj_dropout``,
Mlp's ``drop2``), which matches ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``.
Parameter names: ``self_attn``, ``cross_attn``, ``mlp``, ``norm1``, ``norm2`` (``norm3``); with
``cfg.sandwich_norm`` (Gemma 2) also ``post_norm1``, ``post_norm2`` (``post_norm3``), applied to each
sublayer's output before the residual add: ``x = x + drop_path(post(f(norm(x))))``.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from tk.core.nn.attention import KVCache, MultiHeadAttention
from tk.core.nn.config import TransformerConfig
from tk.core.nn.layers import DropPath, Mlp, RMSNorm, build_norm
from tk.core.nn.rope import build_rotary

__all__ = ["EncoderLayer", "DecoderLayer", "DecoderOnlyLayer", "Mlp", "DropPath", "RMSNorm", "build_norm"]


def norm_of(cfg: TransformerConfig, dim: int | None = None) -> nn.Module:
    """A norm of ``cfg`` (kind, epsilon, LayerNorm bias, RMSNorm weight offset) over ``dim`` (default D)."""
    return build_norm(cfg.norm, cfg.dim if dim is None else dim, cfg.norm_eps, cfg.norm_bias, cfg.norm_weight_offset)


def build_attention(cfg: TransformerConfig, *, cross: bool = False, rotary: nn.Module | None = None,
                    window: int | None = None) -> MultiHeadAttention:
    """The attention of a layer of ``cfg``: heads (and their width), kv heads, biases, dropouts,
    q/k norms, score scale and soft-cap from the config; ``window`` for sliding-window layers."""
    qkv_bias, proj_bias, _ = cfg.biases()
    return MultiHeadAttention(
        cfg.dim, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, qkv_bias=qkv_bias, proj_bias=proj_bias,
        attn_dropout=cfg.attn_dropout_p, proj_dropout=cfg.dropout, cross_attention=cross, rotary=rotary,
        head_dim=cfg.head_dim, qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None, scale=cfg.attn_scale,
        softcap=cfg.attn_logit_softcapping, window=None if cross else window,
    )


def _self_attention(cfg: TransformerConfig, rotary: nn.Module | None, window: int | None = None) -> MultiHeadAttention:
    """Self-attention with the given rotary module, or one of its own for rotary positions."""
    if rotary is None and cfg.pos_encoding == "rotary":
        rotary = build_rotary(cfg)
    return build_attention(cfg, rotary=rotary, window=window)


def build_mlp(cfg: TransformerConfig) -> Mlp:
    """The feed-forward of a layer of ``cfg``: width, activation, bias and dropouts."""
    return Mlp(cfg.dim, cfg.ffn_dim, activation=cfg.activation, dropout=cfg.mlp_dropout_p, bias=cfg.biases()[2],
               proj_dropout=cfg.dropout)


class _Sublayers(nn.Module):
    """Shared constructor pieces: residual wiring, norms, feed-forward."""

    def __init__(self, cfg: TransformerConfig, drop_path: float, *, cross: bool = False) -> None:
        super().__init__()
        cfg.validate()
        self.norm_first = cfg.norm_first
        self.mlp = build_mlp(cfg)
        self.norm1 = norm_of(cfg)
        self.norm2 = norm_of(cfg)
        if cross:  # built here, not in DecoderLayer, to keep the parameter order optimiser states rely on
            self.norm3 = norm_of(cfg)
        self.post_norms = {}  # sandwich norms by their pre-norm's name (Gemma 2)
        if cfg.sandwich_norm:
            for i in range(1, 4 if cross else 3):
                setattr(self, f"post_norm{i}", norm_of(cfg))
                self.post_norms[f"norm{i}"] = f"post_norm{i}"
        self.drop_path = DropPath(drop_path)

    def _residual(self, x: Tensor, fn: Callable[[Tensor], Tensor], norm: nn.Module) -> Tensor:
        branch = fn(norm(x)) if self.norm_first else fn(x)
        if self.post_norms:
            branch = getattr(self, self.post_norms[self._norm_name(norm)])(branch)
        if self.training:  # DropPath is the identity in eval (skipped: per-token decoding overhead)
            branch = self.drop_path(branch)
        return x + branch if self.norm_first else norm(x + branch)


    def _norm_name(self, norm: nn.Module) -> str:
        return next(n for n in ("norm1", "norm2", "norm3") if getattr(self, n, None) is norm)


class EncoderLayer(_Sublayers):
    """Self-attention + feed-forward (the Transformer encoder layer)."""

    default_causal = False

    def __init__(self, cfg: TransformerConfig, *, drop_path: float = 0.0, rotary: nn.Module | None = None,
                 window: int | None = None) -> None:
        """Args:
            cfg: every option (dim, heads, kv heads, FFN, activation, norm, dropouts, bias).
            drop_path: stochastic-depth probability of each residual branch of this layer
                (a stack sets it from ``cfg.drop_path_rate``).
            rotary: a ``RotaryEmbedding`` shared by the layers of a stack; default: one of
                its own when ``cfg.pos_encoding == "rotary"``, else none.
            window: sliding window of this layer's self-attention (a stack passes
                ``cfg.window_of(i)``); None = full attention.

        Raises:
            ValueError: on any ``cfg.check()`` problem.
        """
        super().__init__(cfg, drop_path)
        self.self_attn = _self_attention(cfg, rotary, window)

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Args:
            x: (B, T, D).
            attn_mask: bool, True = masked, (T, T) / (B, T, T) / (B, H, T, T).
            key_padding_mask: (B, Tk) bool, True at padding (Tk includes cached keys).
            is_causal: causal self-attention; default False here, True for DecoderOnlyLayer.
            cache: self-attention ``KVCache`` for incremental decoding.
            positions: (B, T) rotary positions (packed documents); default consecutive.

        Returns:
            (B, T, D).
        """
        causal = self.default_causal if is_causal is None else is_causal
        x = self._residual(
            x,
            lambda h: self.self_attn(
                h, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=causal, cache=cache,
                positions=positions,
            ),
            self.norm1,
        )
        return self._residual(x, self.mlp, self.norm2)


class DecoderOnlyLayer(EncoderLayer):
    """Causal self-attention + feed-forward (GPT-style layer). Same arguments as EncoderLayer;
    ``is_causal`` defaults to True."""

    default_causal = True


class DecoderLayer(_Sublayers):
    """Causal self-attention + cross-attention to the encoder output + feed-forward."""

    def __init__(self, cfg: TransformerConfig, *, drop_path: float = 0.0, rotary: nn.Module | None = None,
                 window: int | None = None) -> None:
        """Args: as :class:`EncoderLayer`; ``rotary`` and ``window`` apply to self-attention only."""
        super().__init__(cfg, drop_path, cross=True)
        self.self_attn = _self_attention(cfg, rotary, window)
        self.cross_attn = build_attention(cfg, cross=True)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        is_causal: bool = True,
        cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
    ) -> Tensor:
        """Args:
            x: (B, Tq, D) target-side states.
            memory: (B, Ts, D) encoder output; may be None once ``cross_cache`` is filled.
            attn_mask: extra bool self-attention mask (True = masked).
            key_padding_mask: (B, Tk) bool, padded target keys (Tk includes cached keys).
            memory_mask: bool cross-attention mask, (Tq, Ts) / (B, Tq, Ts) / (B, H, Tq, Ts).
            memory_key_padding_mask: (B, Ts) bool, padded source positions.
            is_causal: causal self-attention (default True).
            cache: ``KVCache()`` for self-attention keys/values.
            cross_cache: ``KVCache(static=True)``: cross-attention keys/values, computed from
                ``memory`` on the first step and reused.

        Returns:
            (B, Tq, D).
        """
        x = self._residual(
            x,
            lambda h: self.self_attn(
                h, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal, cache=cache
            ),
            self.norm1,
        )
        x = self._residual(
            x,
            lambda h: self.cross_attn(
                h, memory, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask, cache=cross_cache
            ),
            self.norm2,
        )
        return self._residual(x, self.mlp, self.norm3)
