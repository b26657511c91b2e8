"""Positional information: sinusoidal, learned and rotary encodings, scaled token
embeddings and ViT position-embedding resampling.

Papers: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762;
RoFormer / rotary embeddings (Su et al., 2021), https://arxiv.org/abs/2104.09864;
ViT (Dosovitskiy et al., 2020), https://arxiv.org/abs/2010.11929.

All additive encodings share one call: ``module(x, offset=0) -> x + encoding`` for
x (B, T, D), where ``offset`` is the position of x's first token (the KV-cache length
during incremental decoding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.nn.config import POS_ENCODINGS, TransformerConfig
from tk.core.nn.rope import RotaryEmbedding  # noqa: F401  (its home before tk.core.nn.rope)


def sinusoidal_table(num_pos: int, dim: int, offset: int = 0, device=None, layout: str = "interleaved") -> Tensor:
    """Sinusoidal encodings for positions offset .. offset + num_pos - 1.

    ``interleaved`` (the paper): PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(...);
    an odd D drops the last cosine column. ``split`` (Marian): the same sines in the first
    ceil(D/2) columns, the cosines after them. ``fairseq`` (tensor2tensor; M2M100, NLLB): split, with
    frequencies 10000^(-i / (D/2 - 1)) and a zero column for an odd D.

    Returns:
        (num_pos, D) float32.
    """
    return _sinusoids(torch.arange(offset, offset + num_pos, dtype=torch.float32, device=device), dim, layout)


def _sinusoids(pos: Tensor, dim: int, layout: str = "interleaved") -> Tensor:
    """Sinusoidal encodings of float positions of any shape (...) -> (..., D)."""
    if layout == "fairseq":
        half = dim // 2
        freqs = torch.exp(torch.arange(half, device=pos.device).float() * -(math.log(10000.0) / max(half - 1, 1)))
        angles = pos[..., None] * freqs
        table = torch.cat([angles.sin(), angles.cos()], dim=-1)
        return F.pad(table, (0, dim - 2 * half))
    two_i = torch.arange(0, dim, 2, dtype=torch.float32, device=pos.device)
    angles = pos[..., None] / torch.pow(10000.0, two_i / dim)  # (..., ceil(D/2))
    if layout == "split":
        return torch.cat([angles.sin(), angles.cos()[..., : dim // 2]], dim=-1)
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # interleave sin, cos
    return table[..., :dim]


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sin/cos encodings, added to the input ("Attention Is All You Need", sec. 3.5).

    The table is a non-persistent buffer of ``max_len`` rows (not a parameter, not saved).
    Positions beyond ``max_len`` are computed on the fly, so this encoding extrapolates to
    any length. ``layout`` and ``first`` reproduce other codebases' tables (see
    :func:`sinusoidal_table`): position p reads the row of p + ``first``.
    """

    def __init__(self, dim: int, max_len: int = 5000, layout: str = "interleaved", first: int = 0) -> None:
        """Args:
            dim: model width D.
            max_len: rows to precompute.
            layout: "interleaved", "split" or "fairseq".
            first: the table position of position 0 (M2M100: 2).
        """
        super().__init__()
        self.dim, self.max_len, self.layout, self.first = dim, max_len, layout, first
        self.register_buffer("pe", sinusoidal_table(max_len, dim, first, layout=layout), persistent=False)

    def reset_buffers(self, device: torch.device | str = "cpu") -> None:
        """The table computed again on ``device`` (a model built on the meta device)."""
        self.pe = sinusoidal_table(self.max_len, self.dim, self.first, device=device, layout=self.layout)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Args:
            x: (B, T, D).
            offset: position of x's first token.
            positions: optional (B, T) long positions of every token, each at most
                ``offset + its index`` (e.g. left-padded rows counting real tokens only).

        Returns:
            (B, T, D) = x + PE[offset : offset + T] (or x + PE[positions]).
        """
        T = x.shape[1]
        if positions is not None:  # bounded by offset + T: no device sync to pick the table
            pe = (self.pe[positions] if offset + T <= self.max_len
                  else _sinusoids((positions + self.first).float(), self.dim, self.layout))
            return x + pe.to(x.dtype)
        if offset + T <= self.max_len:
            pe = self.pe[offset : offset + T]
        else:
            pe = sinusoidal_table(T, self.dim, offset + self.first, device=x.device, layout=self.layout)
        return x + pe.to(x.dtype)


def _check_len(length: int, max_len: int, what: str) -> None:
    if length > max_len:
        raise ValueError(
            f"sequence length ({length}) exceeds max_len ({max_len}) of {what}; "
            f"build the model with a larger max_len (at least {length})"
        )


class LearnedPositionalEmbedding(nn.Module):
    """A learned table of ``max_len`` position vectors, added to the input (BERT/GPT-2 style).

    Does not extrapolate: longer sequences raise ValueError.
    """

    def __init__(self, max_len: int, dim: int, init_std: float = 0.02) -> None:
        """Args:
            max_len: number of positions.
            dim: model width D.
            init_std: std of the normal initialisation.
        """
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.randn(max_len, dim) * init_std)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Add the rows of the table: arguments as :meth:`SinusoidalPositionalEncoding.forward`.

        Returns:
            (B, T, D) = x + weight[offset : offset + T] (or x + weight[positions]).

        Raises:
            ValueError: if ``offset + T > max_len``.
        """
        _check_len(offset + x.shape[1], self.max_len, "LearnedPositionalEmbedding")
        if positions is not None:
            return x + self.weight[positions]
        return x + self.weight[offset : offset + x.shape[1]]


class TokenEmbedding(nn.Embedding):
    """Token embedding multiplied by sqrt(D), as in "Attention Is All You Need" (sec. 3.4).

    Subclasses ``nn.Embedding`` so ``.weight`` (V, D) can be tied to an output projection.
    With ``scale=True`` the weights start as N(0, D^-1/2) so the scaled output has unit
    variance (fairseq's choice); the padding row starts at zero.
    """

    def __init__(self, vocab_size: int, dim: int, padding_idx: int | None = None, scale: bool = True) -> None:
        """Args:
            vocab_size: V.
            dim: D.
            padding_idx: id whose row is zero and gets no gradient.
            scale: multiply the output by sqrt(D).
        """
        super().__init__(vocab_size, dim, padding_idx=padding_idx)
        self.scale = math.sqrt(dim) if scale else 1.0
        if scale:
            with torch.no_grad():
                nn.init.normal_(self.weight, std=dim**-0.5)
                if padding_idx is not None:
                    self.weight[padding_idx].zero_()

    def forward(self, tokens: Tensor) -> Tensor:
        """(B, T) ids -> (B, T, D)."""
        x = super().forward(tokens)
        return x if self.scale == 1.0 else x * self.scale  # skip a full pass (and a decode-step op)


def build_positions(cfg: TransformerConfig) -> nn.Module | None:
    """The additive position module of ``cfg.pos_encoding`` (None for "rotary", applied inside
    attention, and for "none").

    Raises:
        ValueError: on an unknown kind.
    """
    if cfg.pos_encoding == "sinusoidal":
        return SinusoidalPositionalEncoding(cfg.dim, cfg.max_len, cfg.sinusoid_layout, cfg.pos_offset)
    if cfg.pos_encoding == "learned":
        return LearnedPositionalEmbedding(cfg.max_len, cfg.dim)
    if cfg.pos_encoding in ("rotary", "none"):
        return None
    raise ValueError(f"pos_encoding ({cfg.pos_encoding!r}) must be one of {POS_ENCODINGS}")


def resample_pos_embed(
    pos_embed: Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resize ViT absolute position embeddings to a new patch grid, keeping prefix tokens.

    The grid part is reshaped to (1, D, h, w), interpolated in float32 and flattened back;
    the first ``num_prefix_tokens`` rows (class/distillation tokens) are kept as they are.

    Args:
        pos_embed: (1, P + h*w, D) embeddings, P = ``num_prefix_tokens``.
        new_grid: target (h', w').
        old_grid: source (h, w); None assumes a square grid.
        num_prefix_tokens: P, rows before the grid.
        interpolation: ``F.interpolate`` mode ("bicubic", "bilinear", ...).
        antialias: antialias when downsampling (bicubic/bilinear only).

    Returns:
        (1, P + h'*w', D) in pos_embed's dtype.

    Raises:
        ValueError: if the grid size does not match the number of rows.
    """
    if pos_embed.dim() != 3:
        raise ValueError(f"pos_embed must have shape (1, P + N, D), got shape {tuple(pos_embed.shape)}")
    n = pos_embed.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(max(n, 0))
        if side * side != n:
            raise ValueError(f"cannot infer a square grid from {n} patch rows; pass old_grid=(h, w)")
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n:
        raise ValueError(
            f"old_grid {tuple(old_grid)} has {old_grid[0] * old_grid[1]} cells but pos_embed has {n} patch rows "
            f"(shape {tuple(pos_embed.shape)}, num_prefix_tokens={num_prefix_tokens})"
        )
    if tuple(new_grid) == tuple(old_grid):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    D = grid.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], D).permute(0, 3, 1, 2)  # (1, D, h, w)
    use_aa = antialias and interpolation in ("bicubic", "bilinear")
    grid = F.interpolate(grid, size=tuple(new_grid), mode=interpolation, antialias=use_aa)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], D).to(pos_embed.dtype)  # (1, N', D)
    return torch.cat([prefix, grid], dim=1)
