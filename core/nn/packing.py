"""Sequence packing: several short sequences share one row, attention stays within each sequence
(a block-diagonal mask for encoders, block-causal for decoders), positions restart at every
sequence, and pooling gives one vector per sequence, so a packed batch computes what the padded
batch computes with fewer padded tokens.

A packed batch names each token's sequence in ``segments`` (R, L): 0 at padding, k for the
k-th sequence of the row (1-based). Rotary positions need no restart: attention within a
sequence depends only on the distance between two positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Packed", "pack_sequences", "segment_attention_mask", "segment_positions", "pool_segments"]


@dataclass
class Packed:
    """A packed batch: ``ids``, ``types`` and ``segments`` (R, L) long."""

    ids: Tensor
    types: Tensor
    segments: Tensor

    @property
    def num_sequences(self) -> int:
        return int(self.segments.amax(1).sum())


def pack_sequences(seqs: Sequence[Sequence[int]], row_len: int, pad_id: int,
                   types: Sequence[Sequence[int]] | None = None) -> Packed:
    """Pack ``seqs`` in order: a sequence goes into the current row if it fits in ``row_len``
    tokens, else it starts the next row (so the sequences keep their order, row-major).

    Raises:
        ValueError: a sequence longer than ``row_len``, an empty one, or types of another length.
    """
    rows: list[list[int]] = []
    for n, s in enumerate(seqs):
        if not 0 < len(s) <= row_len:
            raise ValueError(f"sequence {n} has {len(s)} tokens; packing needs 1 to row_len ({row_len})")
        if types is not None and len(types[n]) != len(s):
            raise ValueError(f"sequence {n} has {len(s)} tokens but {len(types[n])} token types")
        if not rows or sum(len(seqs[i]) for i in rows[-1]) + len(s) > row_len:
            rows.append([])
        rows[-1].append(n)
    width = max(sum(len(seqs[i]) for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    kinds = torch.zeros_like(ids)
    segments = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        start = 0
        for k, i in enumerate(row, start=1):
            end = start + len(seqs[i])
            ids[r, start:end] = torch.as_tensor(seqs[i])
            if types is not None:
                kinds[r, start:end] = torch.as_tensor(types[i])
            segments[r, start:end] = k
            start = end
    return Packed(ids, kinds, segments)


def segment_attention_mask(segments: Tensor, causal: bool = False) -> Tensor:
    """(R, L, L) bool, True = masked: a token attends to the tokens of its own sequence (``causal``:
    to those at or before it, the block-causal "document" mask of packed decoder rows); a padded
    position attends to itself only (its output means nothing; a row of all-masked keys would be NaN)."""
    same = (segments.unsqueeze(2) == segments.unsqueeze(1)) & (segments != 0).unsqueeze(1)
    if causal:
        L = segments.shape[1]
        same = same & torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    eye = torch.eye(segments.shape[1], dtype=torch.bool, device=segments.device)
    return ~(same | eye)


def segment_positions(segments: Tensor) -> Tensor:
    """(R, L) long: each token's position within its sequence (0 at its first token; 0 at padding)."""
    L = segments.shape[1]
    index = torch.arange(L, device=segments.device).expand_as(segments)
    starts = segments != torch.nn.functional.pad(segments[:, :-1], (1, 0), value=-1)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return torch.where(segments != 0, index - first, torch.zeros_like(index))


def pool_segments(hidden: Tensor, segments: Tensor, how: str) -> Tensor:
    """One vector per sequence, in row-major sequence order: ``"cls"`` (its first token),
    ``"mean"`` or ``"max"`` over its tokens.

    Args:
        hidden: (R, L, D). segments: (R, L) long, as :func:`pack_sequences` gives.

    Returns:
        (N, D), N the number of sequences.
    """
    R, L, D = hidden.shape
    per_row = segments.amax(1)  # sequences in each row
    offset = torch.cumsum(per_row, 0) - per_row  # index of each row's first sequence
    seq = (offset.unsqueeze(1) + segments - 1)[segments != 0]  # (tokens,) the sequence of each real token
    flat = hidden[segments != 0]  # (tokens, D), row-major
    n = int(per_row.sum())
    if how == "cls":
        firsts = segment_positions(segments)[segments != 0] == 0
        return flat[firsts]
    if how == "mean":
        sums = torch.zeros(n, D, dtype=hidden.dtype, device=hidden.device).index_add_(0, seq, flat)
        counts = torch.bincount(seq, minlength=n).clamp(min=1).to(hidden.dtype)
        return sums / counts.unsqueeze(1)
    if how == "max":
        out = torch.full((n, D), torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=hidden.device)
        return out.scatter_reduce(0, seq.unsqueeze(1).expand(-1, D), flat, reduce="amax", include_self=True)
    raise ValueError(f"pooling ({how!r}) must be one of cls, mean, max")
