"""Transformer stacks and models built from one :class:`TransformerConfig`: encoder, decoder,
encoder-decoder (seq2seq), with KV-cached incremental decoding for generation; the decoder-only
language model lives in :mod:`tk.core.nn.lm` (re-exported here).

Papers: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762;
weight tying, "Using the Output Embedding to Improve Language Models" (Press & Wolf, 2017),
https://arxiv.org/abs/1608.05859; GPT-2 (Radford et al., 2019).

Generation API (both models): ``init_cache(batch, max_len)`` -> :class:`DecoderCache`;
``decode_step(...)`` feeds the new tokens and returns their logits, appending to the cache;
``reorder_cache(cache, beam_indices)`` reorders batch rows for beam search.
The models must be in ``eval()`` mode and run under ``torch.no_grad()`` for decoding.

Layer ids (``optim.layer_decay``): embeddings 0, layer i of the first stack i + 1, the
decoder's layers after the encoder's, the output projection and last norm ``num_layers()``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tk.core.nn.blocks import DecoderLayer, EncoderLayer
from tk.core.nn.config import TransformerConfig
from tk.core.nn.lm import DecoderOnlyLM
from tk.core.nn.masks import padding_mask
from tk.core.nn.pos_embed import TokenEmbedding, build_positions
from tk.core.nn.stack import DecoderCache, TransformerStack

__all__ = ["TransformerEncoder", "TransformerDecoder", "EncoderDecoder", "DecoderOnlyLM", "DecoderCache"]


class TransformerEncoder(TransformerStack):
    """A stack of :class:`EncoderLayer` with an optional final norm (``cfg.use_final_norm``)."""

    def __init__(self, cfg: TransformerConfig, depth: int | None = None) -> None:
        """Args:
            cfg: the layers' options.
            depth: layers; default ``cfg.encoder_depth``, else ``cfg.depth``.
        """
        super().__init__(cfg, EncoderLayer, depth or cfg.encoder_depth or cfg.depth)

    def forward(
        self, x: Tensor, *, key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Args:
            x: (B, T, D). key_padding_mask: (B, T) bool, True at padding.
            attn_mask: bool, True = masked. is_causal: causal self-attention.

        Returns:
            (B, T, D).
        """
        return self.run_layers(x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal)


class TransformerDecoder(TransformerStack):
    """A stack of :class:`DecoderLayer` (causal self-attn + cross-attn + FFN), optional final norm."""

    def __init__(self, cfg: TransformerConfig, depth: int | None = None) -> None:
        """Args:
            cfg: the layers' options.
            depth: layers; default ``cfg.decoder_depth``, else ``cfg.depth``.
        """
        super().__init__(cfg, DecoderLayer, depth or cfg.decoder_depth or cfg.depth)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        is_causal: bool = True,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """Args:
            x: (B, Tq, D) target states. memory: (B, Ts, D) encoder output (may be None
                once the cache's cross-attention part is filled).
            key_padding_mask: (B, Tk) bool target padding (Tk includes cached positions).
            attn_mask: extra bool self-attention mask. memory_key_padding_mask: (B, Ts) bool.
            memory_mask: bool cross-attention mask. is_causal: causal self-attention.
            cache: a :class:`DecoderCache` with ``cross_attn`` for incremental decoding.

        Returns:
            (B, Tq, D).
        """
        return self.run_layers(
            x, memory, attn_mask=attn_mask, key_padding_mask=key_padding_mask, memory_mask=memory_mask,
            memory_key_padding_mask=memory_key_padding_mask, is_causal=is_causal, cache=cache,
        )


def _init_linears(module: nn.Module) -> None:
    """Xavier-uniform weights, zero biases (as ``nn.Transformer`` initialises its layers)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class EncoderDecoder(nn.Module):
    """The sequence-to-sequence Transformer: embeddings (scaled by sqrt(D)) + positions +
    dropout, encoder, decoder, output projection ``lm_head`` (tied with ``cfg.tie_embeddings``).

    Generation: ``memory = model.encode(src)``, ``cache = model.init_cache(B, max_len)``, then
    repeatedly ``logits = model.decode_step(tokens_new, memory, model.src_key_padding_mask(src), cache)``.
    """

    def __init__(
        self, cfg: TransformerConfig, src_vocab_size: int, tgt_vocab_size: int, *, pad_id: int | None = None
    ) -> None:
        """Args:
            cfg: the model (``encoder_depth``/``decoder_depth``, default ``depth``; positions up to
                ``max_len``; ``tie_embeddings``: ``lm_head.weight`` is the target embedding;
                ``share_embeddings``: one embedding for source and target).
            src_vocab_size / tgt_vocab_size: vocabularies.
            pad_id: padding id: its embedding row is zero, and the source padding mask is
                derived from it when not given.

        Raises:
            ValueError: on mismatched vocabularies with ``share_embeddings``, or any
                ``cfg.check()`` problem.
        """
        super().__init__()
        cfg.validate()
        if cfg.share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                f"share_embeddings needs equal vocabularies, got src_vocab_size ({src_vocab_size}) and "
                f"tgt_vocab_size ({tgt_vocab_size}); use a joint vocabulary or share_embeddings=False"
            )
        self.pad_id = pad_id
        self.src_embed = TokenEmbedding(src_vocab_size, cfg.dim, pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else TokenEmbedding(tgt_vocab_size, cfg.dim, pad_id)
        self.src_pos, self.tgt_pos = build_positions(cfg), build_positions(cfg)
        self.embed_drop = nn.Dropout(cfg.dropout)
        self.encoder = TransformerEncoder(cfg)
        self.decoder = TransformerDecoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, tgt_vocab_size, bias=False)
        _init_linears(self.encoder)
        _init_linears(self.decoder)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=cfg.dim**-0.5)
        self.pad_aware_positions = cfg.pad_aware_positions
        # Marian's final_logits_bias: saved with the weights, never trained (a buffer, as there)
        self.logits_bias = nn.Buffer(torch.zeros(1, tgt_vocab_size)) if cfg.logits_bias else None

    def _logits(self, x: Tensor) -> Tensor:
        logits = self.lm_head(x)
        return logits if self.logits_bias is None else logits + self.logits_bias.to(logits.dtype)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of every encoder and decoder layer in training (see
        :class:`TransformerStack`); generation is unaffected."""
        self.encoder.set_grad_checkpointing(enable)
        self.decoder.set_grad_checkpointing(enable)

    def num_layers(self) -> int:
        """encoder layers + decoder layers + 1 (the head)."""
        return len(self.encoder.layers) + len(self.decoder.layers) + 1

    def layer_id(self, name: str) -> int:
        """Embeddings 0, encoder layer i -> i + 1, its final norm and then the decoder's layers
        after them, the decoder's final norm and ``lm_head`` -> ``num_layers()``."""
        stack, _, rest = name.partition(".")
        if stack == "encoder":
            return self.encoder.layer_id(rest)
        if stack == "decoder":
            return len(self.encoder.layers) + self.decoder.layer_id(rest)
        return self.num_layers() if stack == "lm_head" else 0

    def src_key_padding_mask(self, src: Tensor) -> Tensor | None:
        """(B, Ts) bool padding mask of ``src`` from ``pad_id``, or None without a pad_id."""
        return None if self.pad_id is None else padding_mask(src, self.pad_id)

    def _embed(self, tokens: Tensor, embed: nn.Module, pos: nn.Module | None, offset: int,
               padding: Tensor | None = None) -> Tensor:
        x = embed(tokens)  # (B, T, D)
        if pos is None:
            return self.embed_drop(x)
        if padding is not None and self.pad_aware_positions:  # count real tokens only (fairseq)
            positions = ((~padding).long().cumsum(1) - 1).clamp(min=0)
            return self.embed_drop(pos(x, offset, positions))
        return self.embed_drop(pos(x, offset))

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """Run the encoder once per source batch.

        Args:
            src: (B, Ts) source ids.
            src_key_padding_mask: (B, Ts) bool, True at padding; default from ``pad_id``.

        Returns:
            memory (B, Ts, D). Pass the same padding mask as ``memory_key_padding_mask`` later.
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_key_padding_mask(src)
        x = self._embed(src, self.src_embed, self.src_pos, 0, src_key_padding_mask)
        return self.encoder(x, key_padding_mask=src_key_padding_mask)

    def decode(
        self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Full (teacher-forced) causal decoding of ``tgt`` (B, Tt) -> logits (B, Tt, V).

        ``tgt_key_padding_mask`` is NOT derived from ``pad_id``: with right-padded targets
        the causal mask already hides every later PAD from real tokens, and leaving it out
        keeps the fast ``is_causal`` attention kernels. Pass it for left-padded targets.
        """
        x = self._embed(tgt, self.tgt_embed, self.tgt_pos, 0)
        x = self.decoder(
            x, memory, key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
            is_causal=True,
        )
        return self._logits(x)

    def forward(
        self, src: Tensor, tgt: Tensor, src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Args:
            src: (B, Ts) source ids. tgt: (B, Tt) target input ids (shifted right).
            src_key_padding_mask: (B, Ts) bool, True at padding; default from ``pad_id``.
            tgt_key_padding_mask: (B, Tt) bool; default None (see :meth:`decode`).

        Returns:
            logits (B, Tt, V_tgt).
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_key_padding_mask(src)
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, src_key_padding_mask, tgt_key_padding_mask)

    def init_cache(self, batch: int, max_len: int | None = None) -> DecoderCache:
        """An empty cache for ``batch`` rows; ``max_len`` target positions are preallocated."""
        return DecoderCache(len(self.decoder.layers), batch, max_len, cross=True)

    def decode_step(
        self, tokens_new: Tensor, memory: Tensor | None, memory_key_padding_mask: Tensor | None,
        cache: DecoderCache, pos_offset: int | None = None,
    ) -> Tensor:
        """Feed new target tokens, appending their keys/values to ``cache``.

        Cross-attention keys/values are computed from ``memory`` on the first call and kept
        in the cache (``memory`` may be None afterwards). Calling with one token at a time
        gives the same logits as :meth:`decode` on the whole prefix.

        Args:
            tokens_new: (B, Tn) ids at positions ``pos_offset .. pos_offset + Tn - 1``
                (usually Tn = 1; the first call typically feeds the BOS token).
            memory: (B, Ts, D) from :meth:`encode` (repeated per beam, e.g. with
                ``repeat_interleave(beam, 0)``, before the first step).
            memory_key_padding_mask: (B, Ts) bool source padding, rows matching ``memory``.
            cache: from :meth:`init_cache`.
            pos_offset: position of ``tokens_new[:, 0]`` for the learned/sinusoidal table;
                default ``cache.length``. Rotary embeddings always use ``cache.length``.

        Returns:
            logits (B, Tn, V_tgt) for the new positions.
        """
        cache.check(tokens_new, needs_cross=True)
        offset = cache.length if pos_offset is None else pos_offset
        x = self._embed(tokens_new, self.tgt_embed, self.tgt_pos, offset)
        x = self.decoder(x, memory, memory_key_padding_mask=memory_key_padding_mask, is_causal=True, cache=cache)
        return self._logits(x)

    def reorder_cache(self, cache: DecoderCache, beam_indices: Tensor) -> DecoderCache:
        """Beam search: row i of every layer's cache becomes old row ``beam_indices[i]``.

        Self- and cross-attention caches are both reordered, in place. Reorder (or keep
        consistent) your own ``memory_key_padding_mask`` rows the same way.

        Returns:
            the same ``cache``.
        """
        cache.reorder(beam_indices)
        return cache
