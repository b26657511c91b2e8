"""Transformer stacks and models: encoder, decoder, encoder-decoder (seq2seq) and a
decoder-only language model, with KV-cached incremental decoding for generation.

Papers: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762;
weight tying, "Using the Output Embedding to Improve Language Models" (Press & Wolf, 2017),
https://arxiv.org/abs/1608.05859; GPT-2 (Radford et al., 2019).

Generation API (both models): ``init_cache(batch, max_len)`` -> :class:`DecoderCache`;
``decode_step(...)`` feeds the new tokens and returns their logits, appending to the cache;
``reorder_cache(cache, beam_indices)`` reorders batch rows for beam search.
The models must be in ``eval()`` mode and run under ``torch.no_grad()`` for decoding.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from tk.core.nn.attention import KVCache
from tk.core.nn.blocks import DecoderLayer, DecoderOnlyLayer, EncoderLayer
from tk.core.nn.layers import build_norm
from tk.core.nn.masks import padding_mask
from tk.core.nn.pos_embed import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
)

POS_ENCODINGS = ("sinusoidal", "learned", "rotary")


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


def _drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic-depth rates rising linearly from 0 to ``rate`` over the layers."""
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


class TransformerEncoder(nn.Module):
    """A stack of :class:`EncoderLayer` with an optional final norm."""

    def __init__(
        self, dim: int, depth: int, num_heads: int, *, final_norm: bool | None = None,
        drop_path_rate: float = 0.0, **layer_kwargs: Any,
    ) -> None:
        """Args:
            dim: D. depth: number of layers. num_heads: H.
            final_norm: norm after the last layer; default = ``norm_first`` (pre-norm stacks
                need it; ``nn.Transformer`` uses one in both modes).
            drop_path_rate: stochastic depth of the last layer (linear from 0).
            **layer_kwargs: :class:`EncoderLayer` arguments (hidden_dim, dropout, activation,
                norm_first, norm, norm_eps, bias, num_kv_heads, rotary, ...).
        """
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderLayer(dim, num_heads, drop_path=p, **layer_kwargs) for p in _drop_path_rates(drop_path_rate, depth)
        )
        final_norm = layer_kwargs.get("norm_first", False) if final_norm is None else final_norm
        eps = layer_kwargs.get("norm_eps", 1e-5)
        self.norm = build_norm(layer_kwargs.get("norm", "layernorm"), dim, eps) if final_norm else nn.Identity()

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
        for layer in self.layers:
            x = layer(x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal)
        return self.norm(x)


class TransformerDecoder(nn.Module):
    """A stack of :class:`DecoderLayer` (causal self-attn + cross-attn + FFN), optional final norm."""

    def __init__(
        self, dim: int, depth: int, num_heads: int, *, final_norm: bool | None = None,
        drop_path_rate: float = 0.0, **layer_kwargs: Any,
    ) -> None:
        """Args: as :class:`TransformerEncoder`, with :class:`DecoderLayer` arguments."""
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(dim, num_heads, drop_path=p, **layer_kwargs) for p in _drop_path_rates(drop_path_rate, depth)
        )
        final_norm = layer_kwargs.get("norm_first", False) if final_norm is None else final_norm
        eps = layer_kwargs.get("norm_eps", 1e-5)
        self.norm = build_norm(layer_kwargs.get("norm", "layernorm"), dim, eps) if final_norm else nn.Identity()

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
        for i, layer in enumerate(self.layers):
            x = layer(
                x, memory, attn_mask=attn_mask, key_padding_mask=key_padding_mask, memory_mask=memory_mask,
                memory_key_padding_mask=memory_key_padding_mask, is_causal=is_causal,
                self_cache=None if cache is None else cache.self_attn[i],
                cross_cache=None if cache is None else cache.cross_attn[i],
            )
        return self.norm(x)


def _build_pos(kind: str, dim: int, max_len: int) -> nn.Module | None:
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(dim, max_len)
    if kind == "learned":
        return LearnedPositionalEmbedding(max_len, dim)
    if kind == "rotary":
        return None  # applied inside attention
    raise ValueError(f"pos_encoding ({kind!r}) must be one of {POS_ENCODINGS}")


def _check_cache(cache: DecoderCache, tokens: Tensor, needs_cross: bool) -> None:
    if needs_cross and cache.cross_attn is None:
        raise ValueError("this cache has no cross-attention part; create it with model.init_cache(...)")
    if tokens.shape[0] != cache.batch_size:
        raise ValueError(
            f"tokens have batch size {tokens.shape[0]} but the cache holds {cache.batch_size} rows; "
            "call reorder_cache(cache, indices) after changing the batch"
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
    dropout, encoder, decoder, output projection ``lm_head`` (optionally tied).

    Generation: ``memory = model.encode(src)``, ``cache = model.init_cache(B, max_len)``, then
    repeatedly ``logits = model.decode_step(tokens_new, memory, model.src_padding_mask(src), cache)``.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        dim: int = 512,
        *,
        encoder_depth: int = 6,
        decoder_depth: int = 6,
        num_heads: int = 8,
        hidden_dim: int | None = None,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        final_norm: bool | None = None,
        max_len: int = 1024,
        pos_encoding: str = "sinusoidal",
        pad_id: int | None = None,
        share_embeddings: bool = False,
        tie_output: bool = True,
        num_kv_heads: int | None = None,
        drop_path_rate: float = 0.0,
    ) -> None:
        """Args:
            src_vocab_size / tgt_vocab_size: vocabularies. dim: D. encoder_depth /
                decoder_depth: layers. num_heads: H. hidden_dim: FFN width (default 4 * D).
            dropout: embedding, residual, FFN and attention dropout. activation: FFN activation.
            norm_first: pre-norm. norm / norm_eps: norm kind and epsilon. final_norm: norm
                after each stack (default ``norm_first``).
            max_len: positions in the table ("learned" raises beyond it; "sinusoidal" and
                "rotary" extrapolate). pos_encoding: "sinusoidal" | "learned" | "rotary".
            pad_id: padding id: its embedding row is zero, and the source padding mask is
                derived from it when not given.
            share_embeddings: one embedding for source and target (needs equal vocabularies).
            tie_output: ``lm_head.weight`` is the target embedding weight.
            num_kv_heads: grouped-query attention. drop_path_rate: stochastic depth.

        Raises:
            ValueError: on mismatched vocabularies with ``share_embeddings``, or unknown options.
        """
        super().__init__()
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                f"share_embeddings needs equal vocabularies, got src_vocab_size ({src_vocab_size}) and "
                f"tgt_vocab_size ({tgt_vocab_size}); use a joint vocabulary or share_embeddings=False"
            )
        self.pad_id = pad_id
        self.src_embed = TokenEmbedding(src_vocab_size, dim, pad_id)
        self.tgt_embed = self.src_embed if share_embeddings else TokenEmbedding(tgt_vocab_size, dim, pad_id)
        self.src_pos, self.tgt_pos = _build_pos(pos_encoding, dim, max_len), _build_pos(pos_encoding, dim, max_len)
        rotary = RotaryEmbedding(dim // num_heads) if pos_encoding == "rotary" and dim % num_heads == 0 else None
        self.embed_drop = nn.Dropout(dropout)
        layer_kwargs = dict(
            hidden_dim=hidden_dim, dropout=dropout, activation=activation, norm_first=norm_first, norm=norm,
            norm_eps=norm_eps, num_kv_heads=num_kv_heads, rotary=rotary, final_norm=final_norm,
            drop_path_rate=drop_path_rate,
        )
        self.encoder = TransformerEncoder(dim, encoder_depth, num_heads, **layer_kwargs)
        self.decoder = TransformerDecoder(dim, decoder_depth, num_heads, **layer_kwargs)
        self.lm_head = nn.Linear(dim, tgt_vocab_size, bias=False)
        _init_linears(self.encoder)
        _init_linears(self.decoder)
        if tie_output:
            self.lm_head.weight = self.tgt_embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=dim**-0.5)

    def src_padding_mask(self, src: Tensor) -> Tensor | None:
        """(B, Ts) bool padding mask of ``src`` from ``pad_id``, or None without a pad_id."""
        return None if self.pad_id is None else padding_mask(src, self.pad_id)

    def _embed(self, tokens: Tensor, embed: nn.Module, pos: nn.Module | None, offset: int) -> Tensor:
        x = embed(tokens)  # (B, T, D)
        return self.embed_drop(x if pos is None else pos(x, offset))

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """Run the encoder once per source batch.

        Args:
            src: (B, Ts) source ids.
            src_key_padding_mask: (B, Ts) bool, True at padding; default from ``pad_id``.

        Returns:
            memory (B, Ts, D). Pass the same padding mask as ``memory_padding_mask`` later.
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_padding_mask(src)
        x = self._embed(src, self.src_embed, self.src_pos, 0)
        return self.encoder(x, key_padding_mask=src_key_padding_mask)

    def decode(
        self, tgt: Tensor, memory: Tensor, memory_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Full (teacher-forced) causal decoding of ``tgt`` (B, Tt) -> logits (B, Tt, V).

        ``tgt_key_padding_mask`` is NOT derived from ``pad_id``: with right-padded targets
        the causal mask already hides every later PAD from real tokens, and leaving it out
        keeps the fast ``is_causal`` attention kernels. Pass it for left-padded targets.
        """
        x = self._embed(tgt, self.tgt_embed, self.tgt_pos, 0)
        x = self.decoder(
            x, memory, key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_padding_mask,
            is_causal=True,
        )
        return self.lm_head(x)

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
            src_key_padding_mask = self.src_padding_mask(src)
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, src_key_padding_mask, tgt_key_padding_mask)

    def init_cache(self, batch: int, max_len: int | None = None) -> DecoderCache:
        """An empty cache for ``batch`` rows; ``max_len`` target positions are preallocated."""
        return DecoderCache(len(self.decoder.layers), batch, max_len, cross=True)

    def decode_step(
        self, tokens_new: Tensor, memory: Tensor | None, memory_padding_mask: Tensor | None,
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
            memory_padding_mask: (B, Ts) bool source padding, rows matching ``memory``.
            cache: from :meth:`init_cache`.
            pos_offset: position of ``tokens_new[:, 0]`` for the learned/sinusoidal table;
                default ``cache.length``. Rotary embeddings always use ``cache.length``.

        Returns:
            logits (B, Tn, V_tgt) for the new positions.
        """
        _check_cache(cache, tokens_new, needs_cross=True)
        offset = cache.length if pos_offset is None else pos_offset
        x = self._embed(tokens_new, self.tgt_embed, self.tgt_pos, offset)
        x = self.decoder(x, memory, memory_key_padding_mask=memory_padding_mask, is_causal=True, cache=cache)
        return self.lm_head(x)

    def reorder_cache(self, cache: DecoderCache, beam_indices: Tensor) -> DecoderCache:
        """Beam search: row i of every layer's cache becomes old row ``beam_indices[i]``.

        Self- and cross-attention caches are both reordered, in place. Reorder (or keep
        consistent) your own ``memory_padding_mask`` rows the same way.

        Returns:
            the same ``cache``.
        """
        cache.reorder(beam_indices)
        return cache


class DecoderOnlyLM(nn.Module):
    """A GPT-style language model: token embedding + positions + dropout, a stack of causal
    :class:`DecoderOnlyLayer`, final norm (pre-norm), ``lm_head`` (optionally tied).

    Generation: ``cache = model.init_cache(B, max_len)``; ``logits = model.decode_step(prompt,
    cache)`` (prefill), then ``model.decode_step(next_token[:, None], cache)`` per step.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int = 256,
        depth: int = 4,
        num_heads: int = 4,
        *,
        hidden_dim: int | None = None,
        max_len: int = 1024,
        dropout: float = 0.0,
        activation: str = "gelu",
        norm_first: bool = True,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        pos_encoding: str = "learned",
        tie_embeddings: bool = True,
        num_kv_heads: int | None = None,
        pad_id: int | None = None,
        bias: bool = True,
        drop_path_rate: float = 0.0,
    ) -> None:
        """Args:
            vocab_size: V. dim: D. depth: layers. num_heads: H. hidden_dim: FFN width
                (default 4 * D). max_len: learned-position table size (raises beyond it;
                "sinusoidal"/"rotary" extrapolate). dropout: all dropouts.
            activation / norm_first / norm / norm_eps / bias / num_kv_heads: layer options.
            pos_encoding: "learned" | "sinusoidal" | "rotary".
            tie_embeddings: ``lm_head.weight`` is the token embedding weight.
            pad_id: padding id (its embedding row starts at zero and gets no gradient).
            drop_path_rate: stochastic depth of the last layer.
        """
        super().__init__()
        self.pad_id = pad_id
        self.tok_embed = TokenEmbedding(vocab_size, dim, pad_id, scale=False)
        self.pos = _build_pos(pos_encoding, dim, max_len)
        rotary = RotaryEmbedding(dim // num_heads) if pos_encoding == "rotary" and dim % num_heads == 0 else None
        self.embed_drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            DecoderOnlyLayer(
                dim, num_heads, hidden_dim, dropout=dropout, activation=activation, norm_first=norm_first,
                norm=norm, norm_eps=norm_eps, bias=bias, drop_path=p, num_kv_heads=num_kv_heads, rotary=rotary,
            )
            for p in _drop_path_rates(drop_path_rate, depth)
        )
        self.norm = build_norm(norm, dim, norm_eps) if norm_first else nn.Identity()
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init_weights)
        if tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

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
        self, tokens: Tensor, offset: int | None, key_padding_mask: Tensor | None, cache: DecoderCache | None
    ) -> Tensor:
        """``offset`` None: positions follow from the padding mask, or start at the cache length."""
        x = self.tok_embed(tokens)  # (B, T, D)
        if self.pos is not None:
            positions = None
            if offset is None and key_padding_mask is not None:
                # Absolute positions count real tokens only (as HF derives position_ids from the
                # attention mask): a left-padded row gets the positions of the unpadded one.
                positions = ((~key_padding_mask).long().cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1] :]
            start = (0 if cache is None else cache.length) if offset is None else offset
            x = self.pos(x, start, positions)
        x = self.embed_drop(x) if self.training else x
        for i, layer in enumerate(self.layers):
            x = layer(x, key_padding_mask=key_padding_mask, cache=None if cache is None else cache.self_attn[i])
        return self.lm_head(self.norm(x))  # (B, T, V)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Args:
            tokens: (B, T) ids.
            key_padding_mask: (B, T) bool, True at padding. Not derived from ``pad_id``:
                right padding needs no mask under causal attention (and without one the
                fast ``is_causal`` kernels run); pass it for left padding. With a mask,
                learned/sinusoidal positions count the unmasked tokens only, so a left-padded
                row gives the same logits as the row alone.

        Returns:
            logits (B, T, V); position t sees tokens 0..t only.
        """
        return self._run(tokens, None, key_padding_mask, None)

    def init_cache(self, batch: int, max_len: int | None = None) -> DecoderCache:
        """An empty cache for ``batch`` rows; ``max_len`` positions are preallocated."""
        return DecoderCache(len(self.layers), batch, max_len, cross=False)

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
        _check_cache(cache, tokens_new, needs_cross=False)
        return self._run(tokens_new, pos_offset, key_padding_mask, cache)

    def reorder_cache(self, cache: DecoderCache, beam_indices: Tensor) -> DecoderCache:
        """Beam search: row i of every layer's cache becomes old row ``beam_indices[i]`` (in place).

        Returns:
            the same ``cache``.
        """
        cache.reorder(beam_indices)
        return cache
