"""The decoder-only language model (GPT, Llama, Gemma, ...): token embedding, positions, a stack of
causal layers, the output projection; with KV-cached incremental decoding for generation.

Papers: GPT-2 (Radford et al., 2019); weight tying, "Using the Output Embedding to Improve
Language Models" (Press & Wolf, 2017), https://arxiv.org/abs/1608.05859.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tk.core.nn.blocks import DecoderOnlyLayer
from tk.core.nn.config import TransformerConfig
from tk.core.nn.packing import segment_attention_mask, segment_positions
from tk.core.nn.pos_embed import TokenEmbedding, build_positions
from tk.core.nn.stack import DecoderCache, TransformerStack

__all__ = ["DecoderOnlyLM"]


class DecoderOnlyLM(nn.Module):
    """A GPT-style language model: token embedding + positions + dropout, a
    :class:`TransformerStack` of causal :class:`DecoderOnlyLayer` (``decoder``: its layers and
    final norm), ``lm_head`` (tied with ``cfg.tie_embeddings``).

    Generation: ``cache = model.init_cache(B, max_len)``; ``logits = model.decode_step(prompt,
    cache)`` (prefill), then ``model.decode_step(next_token[:, None], cache)`` per step.
    """

    def __init__(self, cfg: TransformerConfig, vocab_size: int, *, pad_id: int | None = None) -> None:
        """Args:
            cfg: the model (``depth`` layers; positions up to ``max_len``: "learned" raises
                beyond it, "sinusoidal"/"rotary" extrapolate; ``tie_embeddings``:
                ``lm_head.weight`` is the token embedding weight).
            vocab_size: V.
            pad_id: padding id (its embedding row starts at zero and gets no gradient).

        Raises:
            ValueError: on any ``cfg.check()`` problem.
        """
        super().__init__()
        cfg.validate()
        self.pad_id = pad_id
        self.tok_embed = TokenEmbedding(vocab_size, cfg.dim, pad_id, scale=False)
        self.pos = build_positions(cfg)
        self.embed_drop = nn.Dropout(cfg.dropout)
        self.decoder = TransformerStack(cfg, DecoderOnlyLayer)
        self.lm_head = nn.Linear(cfg.dim, vocab_size, bias=False)
        # Gemma: embeddings times sqrt(D), the factor rounded to the weights' dtype as transformers does
        self.embed_scale = math.sqrt(cfg.dim) if cfg.scale_embedding else None
        self.final_softcap = cfg.final_logit_softcapping
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of every layer in training (see :class:`TransformerStack`);
        generation is unaffected."""
        self.decoder.set_grad_checkpointing(enable)

    def num_layers(self) -> int:
        """layers + 1 (the head)."""
        return self.decoder.num_layers()

    def layer_id(self, name: str) -> int:
        """Embeddings 0, layer i -> i + 1, final norm and ``lm_head`` -> ``num_layers()``."""
        stack, _, rest = name.partition(".")
        if stack == "decoder":
            return self.decoder.layer_id(rest)
        return self.num_layers() if stack == "lm_head" else 0

    def _init_weights(self, m: nn.Module) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, zero padding row."""
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
            if m.padding_idx is not None:
                nn.init.zeros_(m.weight[m.padding_idx])

    def _run(
        self, tokens: Tensor, offset: int | None, key_padding_mask: Tensor | None, cache: DecoderCache | None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """``offset`` None: positions follow from the padding mask, or start at the cache length;
        ``segments``: packed documents (positions restart, a block-causal mask)."""
        x = self.tok_embed(tokens)  # (B, T, D)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        packed = {}
        if segments is not None:
            positions = segment_positions(segments)
            packed = {"attn_mask": segment_attention_mask(segments, causal=True)}
            if self.pos is None:  # rotary: each document rotated as it is alone (exact, not only relative)
                packed["positions"] = positions
            else:
                x = self.pos(x, 0, positions)
        elif self.pos is not None:
            positions = None
            if offset is None and key_padding_mask is not None:
                # Absolute positions count real tokens only (as HF derives position_ids from the
                # attention mask): a left-padded row gets the positions of the unpadded one.
                positions = ((~key_padding_mask).long().cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1] :]
            start = (0 if cache is None else cache.length) if offset is None else offset
            x = self.pos(x, start, positions)
        x = self.embed_drop(x) if self.training else x
        logits = self.lm_head(self.decoder(x, key_padding_mask=key_padding_mask, cache=cache, **packed))  # (B, T, V)
        if self.final_softcap is not None:  # Gemma 2: logits squashed into (-c, c)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None,
                segments: Tensor | None = None) -> Tensor:
        """Args:
            tokens: (B, T) ids.
            key_padding_mask: (B, T) bool, True at padding. Not derived from ``pad_id``:
                right padding needs no mask under causal attention (and without one the
                fast ``is_causal`` kernels run); pass it for left padding. With a mask,
                learned/sinusoidal positions count the unmasked tokens only, so a left-padded
                row gives the same logits as the row alone.
            segments: (B, T) long, packed documents: k at the tokens of a row's k-th document
                (1-based), 0 at padding (:mod:`tk.core.nn.packing`). Each token attends to the
                earlier tokens of its own document only and positions restart at each, so every
                document gets the logits it gets alone.

        Returns:
            logits (B, T, V); position t sees tokens 0..t only.
        """
        return self._run(tokens, None, key_padding_mask, None, segments)

    def init_cache(self, batch: int, max_len: int | None = None) -> DecoderCache:
        """An empty cache for ``batch`` rows; ``max_len`` positions are preallocated."""
        return DecoderCache(len(self.decoder.layers), batch, max_len, cross=False)

    def decode_step(
        self, tokens_new: Tensor, cache: DecoderCache, pos_offset: int | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Feed new tokens (a prompt, then one token per step), appending to ``cache``.

        Args:
            tokens_new: (B, Tn) ids at positions ``pos_offset .. pos_offset + Tn - 1``.
            cache: from :meth:`init_cache`.
            pos_offset: position of ``tokens_new[:, 0]`` for the learned/sinusoidal table;
                default: derived from ``key_padding_mask`` when given, else ``cache.length``.
                Rotary embeddings always use ``cache.length`` (they are relative, so padding
                does not shift them).
            key_padding_mask: (B, cache.length + Tn) bool over ALL keys (cached + new), True
                at padding. Not derived from ``pad_id`` here. Learned/sinusoidal positions
                then count the unmasked keys only, so a left-padded prompt continues exactly
                like the unpadded one; pass the mask on every later step too.

        Returns:
            logits (B, Tn, V) for the new positions.
        """
        cache.check(tokens_new, needs_cross=False)
        return self._run(tokens_new, pos_offset, key_padding_mask, cache)

    def reorder_cache(self, cache: DecoderCache, beam_indices: Tensor) -> DecoderCache:
        """Beam search: row i of every layer's cache becomes old row ``beam_indices[i]`` (in place).

        Returns:
            the same ``cache``.
        """
        cache.reorder(beam_indices)
        return cache
