"""Multi-head attention: a fused path on ``F.scaled_dot_product_attention``, an explicit
reference path that returns the weights, and a KV cache for incremental decoding.

Papers: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762;
grouped-query attention, "GQA" (Ainslie et al., 2023), https://arxiv.org/abs/2305.13245;
multi-query attention (Shazeer, 2019), https://arxiv.org/abs/1911.02150.

Masks follow :mod:`tk.core.nn.masks`: bool, True = masked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.nn.kv_cache import KVCache
from tk.core.nn.layers import RMSNorm
from tk.core.nn.masks import causal_mask, merge_masks, sliding_window_mask

# enable_gqa arrived in torch 2.5; older versions get k/v expanded to H heads instead.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _expand_kv(k: Tensor, v: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """Repeat each of the Hkv key/value heads H // Hkv times: (B, Hkv, Tk, Dh) -> (B, H, Tk, Dh)."""
    rep = num_heads // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _causal_to_mask(mask: Tensor | None, tq: int, tk: int, device: torch.device) -> Tensor:
    causal = causal_mask(tq, device=device, num_keys=tk)  # (Tq, Tk), bottom-right aligned
    return causal if mask is None else mask | causal


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Explicit matmul-softmax-matmul attention; slow, but returns the weights.

    Same arguments and semantics as :func:`scaled_dot_product_attention`. Scores and softmax
    are computed in float32 for half-precision inputs. Masked scores are filled with
    ``finfo.min`` (not -inf) and fully masked rows get zero weights, so nothing is NaN.

    Returns:
        out (B, H, Tq, Dh) and weights (B, H, Tq, Tk) (before dropout).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    k, v = _expand_kv(k, v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if is_causal:
        mask = _causal_to_mask(mask, tq, tk, q.device)
    scores = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, Tq, Tk)
    if softcap is not None:  # Gemma 2: scores squashed into (-c, c) before masking
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1)
    if mask is not None:
        weights = weights.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    weights = weights.to(q.dtype)
    used = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return used @ v, weights


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention on the fused ``F.scaled_dot_product_attention`` kernels, tk mask convention.

    This is the one place where tk's bool mask (True = masked) is inverted into SDPA's
    (True = may attend). A query row whose keys are all masked outputs zeros, with finite
    gradients (SDPA alone would give NaN).

    Args:
        q: (B, H, Tq, Dh) queries.
        k: (B, Hkv, Tk, Dh) keys; H must be a multiple of Hkv (grouped/multi-query).
        v: (B, Hkv, Tk, Dh) values.
        mask: bool, True = masked, broadcastable to (B, H, Tq, Tk) (see ``merge_masks``).
        is_causal: add a causal mask. Queries are the last Tq of Tk positions (bottom-right
            aligned, as in cached decoding); with Tq == Tk this is the usual causal mask and,
            without other masks, runs as SDPA's ``is_causal`` (no mask is materialised).
            With Tq == 1 it is a no-op (the newest token sees every key).
        dropout_p: dropout on the attention weights (pass 0.0 in eval).
        need_weights: use the explicit reference path and also return the weights.
        scale: score scale; defaults to 1/sqrt(Dh).
        softcap: scores become ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2);
            the fused kernels cannot, so this runs the reference path.

    Returns:
        out (B, H, Tq, Dh), and weights (B, H, Tq, Tk) when ``need_weights`` else None.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    if need_weights or softcap is not None:
        out, weights = attention_reference(q, k, v, mask, is_causal, dropout_p, scale, softcap)
        return out, weights if need_weights else None
    if is_causal and (tq == 1 or mask is not None or tq != tk):
        if tq > 1:  # SDPA's is_causal is top-left aligned and excludes masks: build it.
            mask = _causal_to_mask(mask, tq, tk, q.device)
        is_causal = False
    extra = {}
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            k, v = _expand_kv(k, v, q.shape[1])
    if mask is None:  # the common path: nothing added around the kernel
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        ), None
    # Rows with every key masked: let the kernel see them unmasked, zero their output after.
    fully_masked = mask.all(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
    # no device sync to fear on CPU; a graph (torch.export/compile) cannot branch on the data
    if q.device.type == "cpu" and not torch.compiler.is_compiling() and not fully_masked.any():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=~mask, dropout_p=dropout_p, scale=scale, **extra
        ), None
    allowed = ~mask | fully_masked  # SDPA convention: True = may attend
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale, **extra)
    return out.masked_fill(fully_masked, 0.0), None


class MultiHeadAttention(nn.Module):
    """Multi-head (optionally grouped-query) self- or cross-attention.

    Parameter names: fused self-attention has ``qkv`` (D -> D + 2 * Hkv * Dh, rows ordered
    q, k, v, each head-major: timm ViT's layout, and ``nn.MultiheadAttention``'s
    ``in_proj_weight``) and output ``proj``. With ``fused_qkv=False``, and always for
    cross-attention, the projections are ``q_proj``, ``k_proj``, ``v_proj``.

    Attributes:
        fused_attn: True runs SDPA's fused kernels; False forces the explicit reference path.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        fused_qkv: bool = True,
        attn_dropout: float = 0.0,
        proj_dropout: float = 0.0,
        cross_attention: bool = False,
        rotary: nn.Module | None = None,
        head_dim: int | None = None,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
    ) -> None:
        """Args:
            dim: model width D.
            num_heads: query heads H; D must be divisible by H (Dh = D // H) unless
                ``head_dim`` is given.
            num_kv_heads: key/value heads Hkv (H must be divisible by it); None = H,
                1 = multi-query attention.
            qkv_bias: bias in the q/k/v projections.
            proj_bias: bias in the output projection.
            fused_qkv: one ``qkv`` linear for self-attention (else ``q_proj/k_proj/v_proj``).
            attn_dropout: dropout on attention weights.
            proj_dropout: dropout on the output (the residual dropout).
            cross_attention: keys/values come from ``context`` (an encoder output).
            rotary: optional :class:`tk.core.nn.rope.RotaryEmbedding` applied to q and k
                (self-attention only).
            head_dim: Dh when it is not D // H (Gemma, Qwen3): q is H * Dh wide, ``proj`` maps
                H * Dh -> D.
            qk_norm_eps: RMSNorm each head's queries and keys (``q_norm``, ``k_norm``, over Dh)
                before rotary, with this epsilon (Qwen3); None = no such norm.
            scale: score scale; None = Dh ** -0.5.
            softcap: attention logit soft-capping (see :func:`scaled_dot_product_attention`).
            window: causal self-attention sees only the last ``window`` positions (itself
                included), also over a KV cache; None = all.

        Raises:
            ValueError: on indivisible dims or head counts.
        """
        super().__init__()
        if dim % num_heads != 0 and head_dim is None:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}), or give head_dim")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if cross_attention and rotary is not None:
            raise ValueError("rotary embeddings apply to self-attention only; pass rotary=None for cross-attention")
        self.dim, self.num_heads, self.num_kv_heads = dim, num_heads, num_kv_heads
        self.head_dim = dim // num_heads if head_dim is None else head_dim
        self.q_dim = num_heads * self.head_dim  # = D unless head_dim was given
        self.cross_attention = cross_attention
        kv_dim = num_kv_heads * self.head_dim
        if fused_qkv and not cross_attention:
            self.qkv = nn.Linear(dim, self.q_dim + 2 * kv_dim, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(dim, self.q_dim, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, kv_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(dim, kv_dim, bias=qkv_bias)
        self.proj = nn.Linear(self.q_dim, dim, bias=proj_bias)
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, qk_norm_eps), RMSNorm(self.head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        self.scale, self.softcap, self.window = scale, softcap, window
        self.attn_dropout = attn_dropout
        self.proj_dropout = nn.Dropout(proj_dropout)
        self.rotary = rotary
        self.fused_attn = True

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, heads, self.head_dim).transpose(1, 2)  # (B, heads, T, Dh)

    def _project(self, x: Tensor, context: Tensor | None, cache: KVCache | None,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Project to heads and apply rotary/cache: q (B, H, Tq, Dh), k/v (B, Hkv, Tk, Dh)."""
        if self.cross_attention:
            q = self._heads(self.q_proj(x), self.num_heads)
            if cache is not None and cache.is_set:
                return (q, *cache.stored())
            if context is None:
                raise ValueError("cross-attention needs `context` (B, Tk, D) unless its KVCache is already filled")
            k = self._heads(self.k_proj(context), self.num_kv_heads)
            v = self._heads(self.v_proj(context), self.num_kv_heads)
        else:
            if context is not None:
                raise ValueError("got `context` but this module is self-attention; build it with cross_attention=True")
            kv_dim = self.num_kv_heads * self.head_dim
            if hasattr(self, "qkv") and cache is not None and self.rotary is None and not self.qk_norm:
                # Decoding: keys and values stay stacked, (2, B, Hkv, T, Dh), in the layout of
                # the qkv rows: 5 view ops instead of 7, and one cache copy for both. (Not without
                # a cache, i.e. training: that layout's backward costs one more copy than split's.)
                B, T, _ = x.shape
                q, kv = self.qkv(x).split([self.q_dim, 2 * kv_dim], dim=-1)
                kv = kv.view(B, T, 2, self.num_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
                return (self._heads(q, self.num_heads), *cache.append_kv(kv))
            if hasattr(self, "qkv"):
                q, k, v = self.qkv(x).split([self.q_dim, kv_dim, kv_dim], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = self._heads(q, self.num_heads)
            k, v = self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary is not None:
                offset = 0 if cache is None else cache.length
                q, k = self.rotary(q, offset, positions), self.rotary(k, offset, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to itself (self-attention) or to ``context`` (cross-attention).

        Args:
            x: (B, Tq, D) queries (and keys/values for self-attention).
            context: (B, Tk, D) keys/values source for cross-attention.
            attn_mask: bool, True = masked: (Tq, Tk), (B, Tq, Tk) or (B, H, Tq, Tk).
            key_padding_mask: (B, Tk) bool, True at padded keys. With a cache, Tk counts the
                cached keys plus the new ones.
            is_causal: causal self-attention. With a cache, the new queries are the last
                positions, so a single new token sees every cached key (no mask needed).
            need_weights: also return the attention weights (runs the reference path).
            cache: a :class:`KVCache` for incremental decoding: self-attention appends the new
                keys/values; cross-attention (``static=True`` cache) computes them from
                ``context`` on the first call and reuses them afterwards.
            positions: (B, Tq) long, rotary positions of the queries/keys (packed documents
                restart at 0); default: consecutive from the cache length.

        Returns:
            (B, Tq, D), or (out, weights (B, H, Tq, Tk)) when ``need_weights``.

        Raises:
            ValueError: on a missing/unexpected ``context``, a cache of the wrong kind, or
                mask shapes that do not match.
        """
        if cache is not None and cache.static != self.cross_attention:
            kind = "static=True" if self.cross_attention else "static=False"
            raise ValueError(f"this {'cross' if self.cross_attention else 'self'}-attention needs a KVCache({kind})")
        B, Tq, _ = x.shape
        q, k, v = self._project(x, context, cache, positions)
        mask = merge_masks(attn_mask, key_padding_mask, tq=Tq, tk=k.shape[2])
        if self.window is not None and k.shape[2] > self.window:  # keys too far back (a shorter input needs none)
            far = sliding_window_mask(Tq, self.window, q.device, num_keys=k.shape[2])
            mask = far if mask is None else mask | far
        out, weights = scaled_dot_product_attention(
            q, k, v, mask, is_causal,
            dropout_p=self.attn_dropout if self.training else 0.0,
            need_weights=need_weights or not self.fused_attn, scale=self.scale, softcap=self.softcap,
        )
        out = self.proj(out.transpose(1, 2).reshape(B, Tq, self.q_dim))  # (B, Tq, H * Dh)
        if self.training:  # dropout is the identity in eval (skipped: per-token decoding overhead)
            out = self.proj_dropout(out)
        return (out, weights) if need_weights else out
