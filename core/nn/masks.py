"""Attention masks: the one mask convention of tk, and helpers to build and convert masks.

Convention (used everywhere in tk): a mask is a **boolean** tensor where **True = masked**
(the query may NOT attend to that key), as ``nn.Transformer`` / ``nn.MultiheadAttention``
take it and as ``tokens.eq(pad_id)`` reads. Masks broadcast to (B, H, Tq, Tk).
``F.scaled_dot_product_attention`` uses the opposite convention; the inversion happens in
exactly one place, :func:`tk.core.nn.attention.scaled_dot_product_attention`.

Paper: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_bool(mask: Tensor, name: str) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor (True = masked), got dtype {mask.dtype}; "
            "convert a 0/1 mask with `.bool()` or an additive float mask with "
            "`tk.core.nn.masks.from_additive(mask)`"
        )


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """Mask padding positions of a token batch.

    Args:
        tokens: (B, T) integer token ids.
        pad_id: id of the padding token.

    Returns:
        (B, T) bool, True where ``tokens == pad_id`` (masked).

    Raises:
        ValueError: if ``tokens`` is not 2-D.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape (B, T), got shape {tuple(tokens.shape)}")
    return tokens.eq(pad_id)


def causal_mask(T: int, device: torch.device | str | None = None, *, num_keys: int | None = None) -> Tensor:
    """Causal (look-ahead) mask: a query may attend only to keys at or before its position.

    With ``num_keys`` (Tk) larger than ``T`` (Tq), the queries are the *last* T positions of a
    length-Tk sequence (bottom-right alignment), as in cached decoding where earlier keys
    come from the KV cache: query i sits at absolute position ``Tk - T + i``.

    Args:
        T: number of queries (Tq).
        device: device of the returned mask.
        num_keys: number of keys (Tk); defaults to ``T``.

    Returns:
        (Tq, Tk) bool, True above the (shifted) diagonal (masked).

    Raises:
        ValueError: if ``num_keys < T`` or ``T < 0``.
    """
    num_keys = T if num_keys is None else num_keys
    if T < 0 or num_keys < T:
        raise ValueError(f"causal_mask needs 0 <= T <= num_keys, got T={T}, num_keys={num_keys}")
    ones = torch.ones(T, num_keys, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=num_keys - T + 1)


def sliding_window_mask(T: int, window: int, device: torch.device | str | None = None, *,
                        num_keys: int | None = None) -> Tensor:
    """Sliding-window mask (Mistral, Gemma 2): query i may not attend to keys ``window`` or more
    positions before it; with the causal mask, each query sees itself and the ``window - 1``
    keys before it. Queries are the last T of ``num_keys`` positions, as in :func:`causal_mask`.

    Returns:
        (Tq, Tk) bool, True where a key is too far back (masked).
    """
    Tk = T if num_keys is None else num_keys
    q = torch.arange(Tk - T, Tk, device=device)[:, None]
    return (q - torch.arange(Tk, device=device)[None, :]) >= window


def merge_masks(
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    *,
    tq: int | None = None,
    tk: int | None = None,
) -> Tensor | None:
    """Combine an attention mask and a key-padding mask into one 4-D bool mask.

    Args:
        attn_mask: bool, True = masked. Shapes: (Tq, Tk) shared by the batch,
            (B, Tq, Tk) per sequence, or (B|1, H|1, Tq, Tk) per head.
        key_padding_mask: (B, Tk) bool, True at padded keys.
        tq: expected number of queries, checked when given.
        tk: expected number of keys, checked when given.

    Returns:
        A bool mask broadcastable to (B, H, Tq, Tk) (4-D, with size-1 dims where the inputs
        broadcast), or None when both inputs are None.

    Raises:
        TypeError: if a mask is not a tensor.
        ValueError: if a mask is not bool, or a shape is not one of the above or disagrees
            with ``tq``/``tk`` or with the other mask.
    """
    out = None
    if attn_mask is not None:
        _check_bool(attn_mask, "attn_mask")
        if attn_mask.dim() == 2:
            out = attn_mask[None, None]  # (1, 1, Tq, Tk)
        elif attn_mask.dim() == 3:
            out = attn_mask[:, None]  # (B, 1, Tq, Tk)
        elif attn_mask.dim() == 4:
            out = attn_mask
        else:
            raise ValueError(
                f"attn_mask must have shape (Tq, Tk), (B, Tq, Tk) or (B, H, Tq, Tk), "
                f"got shape {tuple(attn_mask.shape)}"
            )
        _check_size(out.shape[-2], tq, "attn_mask", "Tq", attn_mask.shape)
        _check_size(out.shape[-1], tk, "attn_mask", "Tk", attn_mask.shape)
    if key_padding_mask is not None:
        _check_bool(key_padding_mask, "key_padding_mask")
        if key_padding_mask.dim() != 2:
            raise ValueError(
                f"key_padding_mask must have shape (B, Tk), got shape {tuple(key_padding_mask.shape)}"
            )
        _check_size(key_padding_mask.shape[-1], tk, "key_padding_mask", "Tk", key_padding_mask.shape)
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, Tk)
        if out is None:
            out = kpm
        else:
            try:
                out = out | kpm
            except RuntimeError as e:
                raise ValueError(
                    f"attn_mask shape {tuple(attn_mask.shape)} and key_padding_mask shape "
                    f"{tuple(key_padding_mask.shape)} do not broadcast (need the same B and Tk)"
                ) from e
    return out


def _check_size(found: int, expected: int | None, name: str, letter: str, shape) -> None:
    if expected is not None and found != 1 and found != expected:
        raise ValueError(f"{name} has {letter}={found} (shape {tuple(shape)}), expected {letter}={expected}")


def to_additive(mask: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """Turn a bool mask (True = masked) into an additive float mask.

    Masked entries get ``torch.finfo(dtype).min`` rather than ``-inf``, so a fully masked
    row gives a finite (uniform) softmax instead of NaN.

    Args:
        mask: bool mask of any shape, or None.
        dtype: floating dtype of the result.

    Returns:
        Float mask of the same shape (0 where allowed, finfo.min where masked), or None.

    Raises:
        ValueError: if ``mask`` is not bool or ``dtype`` is not floating point.
    """
    if mask is None:
        return None
    _check_bool(mask, "mask")
    if not dtype.is_floating_point:
        raise ValueError(f"to_additive needs a floating dtype, got {dtype}")
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(mask, torch.finfo(dtype).min)


def from_additive(mask: Tensor | None) -> Tensor | None:
    """Turn an additive float mask (0 = allowed, -inf or very negative = masked) into bool.

    Entries <= ``finfo(dtype).min / 2`` (this includes ``-inf`` and ``finfo.min``) count as
    masked.

    Args:
        mask: float mask of any shape, or None.

    Returns:
        Bool mask of the same shape (True = masked), or None.

    Raises:
        ValueError: if ``mask`` is not floating point, or holds values other than 0 and
            "masked" (that is an attention bias, not a mask, and cannot be made bool).
    """
    if mask is None:
        return None
    if not mask.dtype.is_floating_point:
        raise ValueError(f"from_additive needs a float mask, got dtype {mask.dtype}; a bool mask needs no conversion")
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if not torch.all(masked | (mask == 0)):
        raise ValueError(
            "additive mask holds values other than 0 and -inf/finfo.min; it is an attention bias, "
            "not a mask, and cannot be converted to bool"
        )
    return masked
