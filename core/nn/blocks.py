"""Transformer layers: encoder layer, encoder-decoder decoder layer and decoder-only layer,
each post-norm (the paper) or pre-norm (``norm_first``).

Papers: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762;
pre-norm, "On Layer Normalization in the Transformer Architecture" (Xiong et al., 2020),
https://arxiv.org/abs/2002.04745.

Sublayer: post-norm ``x = norm(x + drop_path(f(x)))``; pre-norm ``x = x + drop_path(f(norm(x)))``.
Residual dropout sits inside the sublayers (attention ``proj_drop``, Mlp's second dropout),
which matches ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` exactly.
Parameter names: ``self_attn``, ``cross_attn``, ``mlp``, ``norm1``, ``norm2`` (``norm3``).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from tk.core.nn.attention import KVCache, MultiHeadAttention
from tk.core.nn.layers import DropPath, Mlp, RMSNorm, build_norm

__all__ = ["EncoderLayer", "DecoderLayer", "DecoderOnlyLayer", "Mlp", "DropPath", "RMSNorm", "build_norm"]


class _Sublayers(nn.Module):
    """Shared constructor pieces: residual wiring, norms, feed-forward."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int | None,
        dropout: float,
        activation: str,
        norm_first: bool,
        norm: str,
        norm_eps: float,
        bias: bool,
        drop_path: float,
        num_norms: int,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.mlp = Mlp(dim, hidden_dim or 4 * dim, activation=activation, dropout=dropout, bias=bias)
        for i in range(1, num_norms + 1):
            setattr(self, f"norm{i}", build_norm(norm, dim, norm_eps))
        self.drop_path = DropPath(drop_path)

    def _residual(self, x: Tensor, fn: Callable[[Tensor], Tensor], norm: nn.Module) -> Tensor:
        branch = fn(norm(x)) if self.norm_first else fn(x)
        if self.training:  # DropPath is the identity in eval (skipped: per-token decoding overhead)
            branch = self.drop_path(branch)
        return x + branch if self.norm_first else norm(x + branch)


class EncoderLayer(_Sublayers):
    """Self-attention + feed-forward (the Transformer encoder layer)."""

    default_causal = False

    def __init__(
        self,
        dim: int,
        num_heads: int,
        hidden_dim: int | None = None,
        *,
        dropout: float = 0.1,
        attn_dropout: float | None = None,
        activation: str = "relu",
        norm_first: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        bias: bool = True,
        drop_path: float = 0.0,
        num_kv_heads: int | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        """Args:
            dim: model width D.
            num_heads: attention heads H.
            hidden_dim: feed-forward width; default 4 * D.
            dropout: residual and feed-forward dropout.
            attn_dropout: dropout on attention weights; default ``dropout`` (as torch).
            activation: "relu" (the paper), "gelu" or "swiglu".
            norm_first: pre-norm if True, post-norm (the paper) if False.
            norm: "layernorm" or "rmsnorm".
            norm_eps: norm epsilon.
            bias: biases in all linear layers.
            drop_path: stochastic-depth probability of each residual branch.
            num_kv_heads: grouped-query attention (see ``MultiHeadAttention``).
            rotary: optional ``RotaryEmbedding`` for self-attention.
        """
        super().__init__(dim, hidden_dim, dropout, activation, norm_first, norm, norm_eps, bias, drop_path, 2)
        self.self_attn = MultiHeadAttention(
            dim, num_heads, num_kv_heads=num_kv_heads, qkv_bias=bias, proj_bias=bias,
            attn_drop=dropout if attn_dropout is None else attn_dropout, proj_drop=dropout, rotary=rotary,
        )

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Args:
            x: (B, T, D).
            attn_mask: bool, True = masked, (T, T) / (B, T, T) / (B, H, T, T).
            key_padding_mask: (B, Tk) bool, True at padding (Tk includes cached keys).
            is_causal: causal self-attention; default False here, True for DecoderOnlyLayer.
            cache: self-attention ``KVCache`` for incremental decoding.

        Returns:
            (B, T, D).
        """
        causal = self.default_causal if is_causal is None else is_causal
        x = self._residual(
            x,
            lambda h: self.self_attn(
                h, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=causal, cache=cache
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

    def __init__(
        self,
        dim: int,
        num_heads: int,
        hidden_dim: int | None = None,
        *,
        dropout: float = 0.1,
        attn_dropout: float | None = None,
        activation: str = "relu",
        norm_first: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        bias: bool = True,
        drop_path: float = 0.0,
        num_kv_heads: int | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        """Args: as :class:`EncoderLayer`; ``rotary`` applies to self-attention only."""
        super().__init__(dim, hidden_dim, dropout, activation, norm_first, norm, norm_eps, bias, drop_path, 3)
        attn_drop = dropout if attn_dropout is None else attn_dropout
        common = dict(num_kv_heads=num_kv_heads, qkv_bias=bias, proj_bias=bias, attn_drop=attn_drop, proj_drop=dropout)
        self.self_attn = MultiHeadAttention(dim, num_heads, rotary=rotary, **common)
        self.cross_attn = MultiHeadAttention(dim, num_heads, cross_attention=True, **common)

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
        self_cache: KVCache | None = None,
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
            self_cache: ``KVCache()`` for self-attention keys/values.
            cross_cache: ``KVCache(static=True)``: cross-attention keys/values, computed from
                ``memory`` on the first step and reused.

        Returns:
            (B, Tq, D).
        """
        x = self._residual(
            x,
            lambda h: self.self_attn(
                h, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal, cache=self_cache
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
