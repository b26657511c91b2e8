"""One generic stack of Transformer layers (stochastic-depth schedule, shared rotary
positions, final norm, KV caches, activation checkpointing, layer ids), used by the encoder,
the decoder and the decoder-only LM; and :class:`DecoderCache`, the per-layer caches of
incremental decoding.

Stochastic depth: "Deep Networks with Stochastic Depth" (Huang et al., 2016),
https://arxiv.org/abs/1603.09382 (linear rule). Activation checkpointing: "Training Deep
Nets with Sublinear Memory Cost" (Chen et al., 2016), https://arxiv.org/abs/1604.06174.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tk.core.nn.kv_cache import KVCache
from tk.core.nn.config import TransformerConfig
from tk.core.nn.layers import build_norm
from tk.core.nn.rope import build_rotary


class DecoderCache:
    """KV caches of every decoder layer, for incremental decoding.

    Attributes:
        self_attn: one growing ``KVCache`` per layer (target keys/values so far).
        cross_attn: one ``KVCache(static=True)`` per layer (encoder keys/values, computed on the
            first step), or None for decoder-only models.
        batch_size: rows the cache was created for (changes with ``reorder``).
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int | None = None, cross: bool = False) -> None:
        self.batch_size = batch_size
        self.self_attn = [KVCache(max_len) for _ in range(num_layers)]
        self.cross_attn = [KVCache(static=True) for _ in range(num_layers)] if cross else None

    @property
    def length(self) -> int:
        """Number of target positions decoded so far (= position of the next token)."""
        return self.self_attn[0].length

    def reorder(self, indices: Tensor) -> None:
        """Row i of every cache becomes old row ``indices[i]`` (in place).

        Args:
            indices: (B',) long; B' may differ from the current batch size.
        """
        for c in self.self_attn + (self.cross_attn or []):
            c.reorder(indices)
        self.batch_size = indices.numel()

    def check(self, tokens: Tensor, needs_cross: bool) -> None:
        """Raise if this cache cannot take ``tokens`` (B, Tn).

        Raises:
            ValueError: no cross-attention part where one is needed, or another batch size.
        """
        if needs_cross and self.cross_attn is None:
            raise ValueError("this cache has no cross-attention part; create it with model.init_cache(...)")
        if tokens.shape[0] != self.batch_size:
            raise ValueError(
                f"tokens have batch size {tokens.shape[0]} but the cache holds {self.batch_size} rows; "
                "call reorder_cache(cache, indices) after changing the batch"
            )


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic-depth rates rising linearly from 0 at the first layer to ``rate`` at the last."""
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


class TransformerStack(nn.Module):
    """``depth`` layers of ``layer_cls`` built from one config, then an optional final norm.

    Layer i drops its residual branches with ``drop_path_rates(cfg.drop_path_rate, depth)[i]``;
    with ``cfg.pos_encoding == "rotary"`` all layers share one ``RotaryEmbedding``. Parameter
    names: ``layers.{i}.*``, ``norm.*``.

    Layer ids (for ``optim.layer_decay``): ``layers.{i}`` -> i + 1, the final norm ->
    ``num_layers()`` = depth + 1, anything else (embeddings of a subclass) -> 0.

    Activation checkpointing (:meth:`set_grad_checkpointing`): each layer's activations are
    recomputed in backward instead of stored, in training mode with gradients on and no KV
    cache; dropout draws the same masks in the recomputation (torch restores the RNG state).
    """

    def __init__(self, cfg: TransformerConfig, layer_cls: type[nn.Module], depth: int | None = None) -> None:
        """Args:
            cfg: the layers' options; ``use_final_norm`` decides the final norm.
            layer_cls: ``EncoderLayer``, ``DecoderLayer``, ``DecoderOnlyLayer`` or any class
                taking ``(cfg, *, drop_path, rotary)``.
            depth: number of layers; default ``cfg.depth``.

        Raises:
            ValueError: on any ``cfg.check()`` problem.
        """
        super().__init__()
        cfg.validate()
        depth = cfg.depth if depth is None else depth
        rotary = build_rotary(cfg) if cfg.pos_encoding == "rotary" else None
        # a window only where one is set: a plugin's own layer class need not take the argument
        windows = [{"window": cfg.window_of(i)} if cfg.sliding_window else {} for i in range(depth)]
        self.layers = nn.ModuleList(
            layer_cls(cfg, drop_path=p, rotary=rotary, **w)
            for p, w in zip(drop_path_rates(cfg.drop_path_rate, depth), windows)
        )
        norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_bias, cfg.norm_weight_offset)
        self.norm = norm if cfg.use_final_norm else nn.Identity()
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each layer's activations in backward instead of storing them (training
        only; incremental decoding with a KV cache never checkpoints)."""
        self.grad_checkpointing = enable

    def run_layers(self, x: Tensor, *args: Any, cache: DecoderCache | None = None, **kwargs: Any) -> Tensor:
        """Every layer, then the final norm; ``args``/``kwargs`` go to each layer as they are.

        Args:
            x: (B, T, D).
            cache: layer i gets ``cache=cache.self_attn[i]`` (and ``cross_cache=cache.cross_attn[i]``
                when the cache has a cross-attention part).

        Returns:
            (B, T, D).
        """
        # A cache is filled in place during forward: recomputing a layer would append twice.
        recompute = self.grad_checkpointing and cache is None and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute:
                x = checkpoint(layer, x, *args, use_reentrant=False, **kwargs)
            elif cache is None:
                x = layer(x, *args, **kwargs)
            elif cache.cross_attn is None:
                x = layer(x, *args, cache=cache.self_attn[i], **kwargs)
            else:
                x = layer(x, *args, cache=cache.self_attn[i], cross_cache=cache.cross_attn[i], **kwargs)
        return self.norm(x)

    forward = run_layers

    def num_layers(self) -> int:
        """Layer ids run 0 (input side) .. depth + 1 (final norm / head)."""
        return len(self.layers) + 1

    def layer_id(self, name: str) -> int:
        """Layer id of parameter ``name`` (see the class docstring)."""
        if name.startswith("layers."):
            return int(name.split(".")[1]) + 1
        if name.startswith("norm."):
            return self.num_layers()
        return 0
