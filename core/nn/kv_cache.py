"""The key/value cache of one attention layer for incremental decoding (a preallocated buffer that
grows, or a compute-once cross-attention cache)."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of one attention layer, kept across incremental decoding steps.

    Keys and values share one buffer (2, B, Hkv, capacity, Dh). Self-attention caches
    (``static=False``) grow by one chunk per step: the buffer is preallocated to ``max_len``
    positions on the first append and doubled if ever exceeded, so an append is one
    in-place copy (of both, with :meth:`append_kv`). Cross-attention caches
    (``static=True``) hold the keys/values computed once from the encoder output; the
    module reuses them on later steps and ignores its ``context``.

    Use under ``torch.no_grad()`` / ``torch.inference_mode()`` (decoding, not training).

    Attributes:
        length: number of positions stored (the position offset of the next token).
        static: whether this is a compute-once cross-attention cache.
    """

    def __init__(self, max_len: int | None = None, *, static: bool = False) -> None:
        """Args:
            max_len: positions to preallocate on first append (a hint; grows if exceeded).
            static: compute-once cache for cross-attention keys/values.
        """
        self.max_len = max_len
        self.static = static
        self.length = 0
        self._kv: Tensor | None = None  # (2, B, Hkv, capacity, Dh): keys [0], values [1]

    @property
    def is_set(self) -> bool:
        """True once keys/values are stored."""
        return self._kv is not None and self.length > 0

    @property
    def k(self) -> Tensor | None:
        """Stored keys (B, Hkv, length, Dh), or None."""
        return None if self._kv is None else self._kv[0, :, :, : self.length]

    @property
    def v(self) -> Tensor | None:
        """Stored values (B, Hkv, length, Dh), or None."""
        return None if self._kv is None else self._kv[1, :, :, : self.length]

    def stored(self) -> tuple[Tensor, Tensor]:
        """Stored keys and values, each (B, Hkv, length, Dh) (views, no copy); needs ``is_set``."""
        return (self._kv if self.static else self._kv.narrow(3, 0, self.length)).unbind(0)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, Hkv, Tn, Dh) and return all of them (B, Hkv, length, Dh).

        For a static cache, the first call stores ``k``/``v`` and later calls return the
        stored ones unchanged.

        Raises:
            ValueError: if batch size, heads or head dim differ from what is stored, or
                keys and values differ in shape (they share one buffer, in the dtype of the
                first keys stored).
        """
        if k.shape != v.shape:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must have the same shape")
        if self.static:
            if not self.is_set:
                self._kv, self.length = torch.stack([k, v]), k.shape[2]
            return self.stored()
        n = self._reserve(k)
        self._kv[0].narrow(2, n, k.shape[2]).copy_(k)
        self._kv[1].narrow(2, n, k.shape[2]).copy_(v)
        return self.stored()

    def append_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`append` for keys and values stacked as (2, B, Hkv, Tn, Dh), in one copy
        (the layout a fused qkv projection gives for free). Growing caches only."""
        if self.static:
            raise ValueError("append_kv is for growing self-attention caches; a static cache takes append(k, v)")
        n = self._reserve(kv[0])
        self._kv.narrow(3, n, kv.shape[3]).copy_(kv)
        return self.stored()

    def _reserve(self, k: Tensor) -> int:
        """Make room for ``k``'s positions (B, Hkv, Tn, Dh); return where they go (and count
        them as stored)."""
        n, need = self.length, self.length + k.shape[2]
        if self._kv is None:
            B, Hkv, _, Dh = k.shape
            self._kv = k.new_empty(2, B, Hkv, max(need, self.max_len or 0), Dh)
        else:
            _, B, Hkv, capacity, Dh = self._kv.shape
            if k.shape[0] != B or k.shape[1] != Hkv or k.shape[3] != Dh:
                raise ValueError(
                    f"KVCache holds (B, Hkv, Dh) = {(B, Hkv, Dh)} but got keys of shape {tuple(k.shape)}; "
                    "after changing the batch call reorder(indices)"
                )
            if need > capacity:
                old = self._kv
                self._kv = old.new_empty(2, B, Hkv, max(need, 2 * capacity), Dh)
                self._kv[:, :, :, :n] = old[:, :, :, :n]
        self.length = need
        return n

    def reorder(self, indices: Tensor) -> None:
        """Select batch rows in place (beam search): row i becomes old row ``indices[i]``.

        Args:
            indices: (B',) long tensor; B' may differ from B (e.g. dropping finished rows).
        """
        if self._kv is None:
            return
        indices = indices.to(self._kv.device)
        if self.static or indices.numel() != self._kv.shape[1]:
            self._kv = self._kv.index_select(1, indices)
        else:  # copy only the filled part, keep the preallocated buffer
            n = self.length
            self._kv[:, :, :, :n] = self._kv[:, :, :, :n].index_select(1, indices)
