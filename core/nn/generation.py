"""Generation on tk's Transformer stacks: greedy search, beam search and sampling, either
KV-cached (``decode_step``) or by recomputing the whole prefix every step (the reference).

Papers: beam search for NMT, "Sequence to Sequence Learning with Neural Networks"
(Sutskever et al., 2014), https://arxiv.org/abs/1409.3215; length normalisation, GNMT
(Wu et al., 2016), https://arxiv.org/abs/1609.08144 (we use fairseq's simpler
``score / len**alpha``); top-k sampling (Fan et al., 2018), https://arxiv.org/abs/1805.04833;
nucleus (top-p) sampling (Holtzman et al., 2020), https://arxiv.org/abs/1904.09751.

Works with any model that has the generation API of :mod:`tk.core.nn.transformer`:
``init_cache``, ``decode_step`` and ``reorder_cache``, plus ``forward`` (decoder-only LM) or
``encode``/``decode`` (encoder-decoder; recognised by its ``encode`` method).

Inputs:

- Decoder-only LM: ``inputs`` is a prompt batch (B, Tp), **right-padded**, with per-row
  lengths from ``prompt_lengths`` or from ``pad_id``. (``decode_step`` also takes
  left-padded prompts with a ``key_padding_mask``, but then every step needs the mask
  and the cache holds the padding.) The shortest prompt's length is prefilled at once and
  the rest is fed one column at a time, each row taking its own prompt token until its
  prompt is used up and its
  generated token afterwards. Every row sees exactly its own tokens at their own
  positions, no padding ever enters the cache, and a padded prompt continues exactly as
  the prompt alone. Each row generates up to ``max_len`` new tokens.
- Encoder-decoder: ``inputs`` is a source batch (B, Ts) padded with the model's ``pad_id``
  (or pass ``src_padding_mask``). The source is encoded once, the decoder starts from
  ``bos_id``, and the cross-attention keys/values are computed once (by the cache).

Output: only generated tokens (no prompt, no BOS), (B, T) with T <= max_len. A sequence
ends with EOS (kept) and every later position is PAD; a sequence without EOS stops at
``max_len``. ``scores`` are ``log_probs / length**length_penalty`` for every strategy,
where ``log_probs`` sums the model's log-probabilities (temperature 1) of the generated
tokens, EOS included, and ``length`` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal

import torch
from torch import Tensor, nn

from tk.core.errors import TkError

STRATEGIES = ("greedy", "beam", "sample")
_NEG_INF = float("-inf")


@dataclass
class GenerationConfig:
    """How to generate; a task plugin exposes it as the recipe section ``generate:``."""

    strategy: Literal["greedy", "beam", "sample"] = "greedy"  # decoding algorithm
    max_len: int = 64  # most new tokens per sequence, EOS included (prompt / BOS not counted)
    min_len: int = 0  # EOS is blocked until this many tokens were generated
    beam_size: int = 4  # hypotheses kept per input (strategy=beam)
    length_penalty: float = 1.0  # alpha in score = sum of log-probs / length**alpha; 0 = raw sum
    temperature: float = 1.0  # sampling: logits are divided by it; 0 = greedy
    top_k: int = 0  # sampling: keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # sampling: keep the fewest tokens whose probabilities sum to >= top_p; 1 = off
    seed: int | None = None  # sampling: seed of a private generator; None = torch's global RNG
    use_cache: bool = True  # KV-cached decode_step; False recomputes the prefix every step (reference)
    bos_id: int | None = None  # first decoder token of an encoder-decoder (required there)
    eos_id: int | None = None  # token that ends a sequence; None = always generate max_len tokens
    pad_id: int | None = None  # fills positions after EOS and pads LM prompts; None = model.pad_id


@dataclass
class GenerationOutput:
    """Generated sequences (best hypothesis per input) and their scores.

    Attributes:
        tokens: (B, T) new token ids, EOS then PAD; T <= max_len.
        scores: (B,) ``log_probs / lengths**length_penalty``.
        log_probs: (B,) sum of log-probabilities of the generated tokens (EOS included).
        lengths: (B,) generated tokens up to and including EOS.
        beam_tokens: (B, K, T) all ``beam_size`` finished hypotheses, best first (beam only).
        beam_scores: (B, K) their scores (beam only).
    """

    tokens: Tensor
    scores: Tensor
    log_probs: Tensor
    lengths: Tensor
    beam_tokens: Tensor | None = None
    beam_scores: Tensor | None = None


# ----------------------------------------------------------------------------- helpers


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (exactly k), set the others to -inf.

    Args:
        logits: (..., V). k: tokens kept; ``k <= 0`` or ``k >= V`` returns ``logits`` unchanged.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, _NEG_INF)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probabilities sum
    to at least ``p``; set the other logits to -inf. The most likely token is always kept.

    Args:
        logits: (..., V). p: in (0, 1]; ``p >= 1`` returns ``logits`` unchanged.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.float().softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = before >= p  # the set already reached p without this token
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, _NEG_INF)


def sample_next(
    log_probs: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row: temperature, then top-k, then top-p on what is left.

    Args:
        log_probs: (R, V) log-probabilities (or logits).
        temperature: divides the logits; 0 means argmax (the limit of temperature -> 0).
        top_k / top_p: see :func:`top_k_filter` / :func:`top_p_filter`.
        generator: for reproducible draws (on the device of ``log_probs``).

    Returns:
        (R,) long token ids.
    """
    if temperature == 0:
        return log_probs.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(log_probs / temperature, top_k), top_p)
    return torch.multinomial(logits.float().softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _check_config(cfg: GenerationConfig) -> None:
    problems = []
    if cfg.strategy not in STRATEGIES:
        problems.append(f"generate.strategy ({cfg.strategy!r}) must be one of {STRATEGIES}")
    if cfg.max_len < 1:
        problems.append(f"generate.max_len ({cfg.max_len}) must be >= 1")
    if not 0 <= cfg.min_len <= cfg.max_len:
        problems.append(f"generate.min_len ({cfg.min_len}) must be in [0, max_len ({cfg.max_len})]")
    if cfg.beam_size < 1:
        problems.append(f"generate.beam_size ({cfg.beam_size}) must be >= 1")
    if cfg.temperature < 0:
        problems.append(f"generate.temperature ({cfg.temperature}) must be >= 0 (0 = greedy)")
    if cfg.top_k < 0:
        problems.append(f"generate.top_k ({cfg.top_k}) must be >= 0 (0 = off)")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"generate.top_p ({cfg.top_p}) must be in (0, 1] (1 = off)")
    if problems:
        raise TkError("; ".join(problems))


def _is_seq2seq(model: nn.Module) -> bool:
    return hasattr(model, "encode")


def _check_model(model: nn.Module, inputs: Tensor) -> None:
    missing = [m for m in ("init_cache", "decode_step", "reorder_cache") if not hasattr(model, m)]
    if missing:
        raise TypeError(f"{type(model).__name__} cannot generate: it lacks {missing} (see tk.core.nn.transformer)")
    if model.training:
        raise ValueError("generation needs the model in eval mode (dropout off): call model.eval() first")
    if not isinstance(inputs, Tensor) or inputs.dim() != 2 or inputs.dtype not in (torch.long, torch.int):
        got = f"shape {tuple(inputs.shape)}, dtype {inputs.dtype}" if isinstance(inputs, Tensor) else type(inputs)
        raise ValueError(f"inputs must be a (B, T) integer token tensor, got {got}")


def _prompt_lengths(prompt: Tensor, prompt_lengths: Tensor | None, pad: int | None) -> Tensor:
    """(B,) prompt lengths, given or derived from right padding with ``pad``."""
    B, Tp = prompt.shape
    if prompt_lengths is not None:
        lengths = torch.as_tensor(prompt_lengths, device=prompt.device).long()
        if lengths.shape != (B,) or bool((lengths > Tp).any()):
            raise ValueError(f"prompt_lengths must be (B,) = ({B},) with values <= Tp ({Tp}), got {lengths.tolist()}")
    elif pad is None:
        lengths = torch.full((B,), Tp, device=prompt.device)
    else:
        is_pad = prompt.eq(pad)
        lengths = (~is_pad).sum(dim=1)
        inside = is_pad & (torch.arange(Tp, device=prompt.device) < lengths[:, None])
        if bool(inside.any()):
            row = int(inside.any(dim=1).nonzero()[0])
            raise ValueError(
                f"prompt row {row} has PAD ({pad}) before a real token: prompts must be right-padded "
                "(left padding is not supported, see tk.core.nn.generation), or pass prompt_lengths"
            )
    if bool((lengths < 1).any()):
        raise ValueError(f"every prompt needs at least one token (e.g. BOS), got lengths {lengths.tolist()}")
    return lengths


# ----------------------------------------------------------------------------- decoding state


class _Decoder:
    """Feeds token columns of R rows to a model and returns the next-token logits.

    Cached: ``decode_step`` on a KV cache. Uncached (the reference): the whole prefix runs
    through ``forward`` / ``decode`` again every step.
    """

    def __init__(
        self, model: nn.Module, rows: int, capacity: int, use_cache: bool,
        memory: Tensor | None = None, memory_mask: Tensor | None = None,
    ) -> None:
        self.model, self.memory, self.memory_mask = model, memory, memory_mask
        self.seq2seq = memory is not None
        self.cache = model.init_cache(rows, capacity) if use_cache else None
        self.history: Tensor | None = None  # (R, t) tokens fed so far (uncached only)

    def feed(self, tokens: Tensor) -> Tensor:
        """tokens (R, Tn) at the next Tn positions -> logits (R, V) for the position after them."""
        if self.cache is not None:
            if self.seq2seq:
                logits = self.model.decode_step(tokens, self.memory, self.memory_mask, self.cache)
                self.memory = None  # cross-attention keys/values now live in the cache
            else:
                logits = self.model.decode_step(tokens, self.cache)
            return logits[:, -1]
        self.history = tokens if self.history is None else torch.cat([self.history, tokens], dim=1)
        # The cached path masks no target key, so neither does the reference (a model with a
        # pad_id would otherwise mask, e.g., a BOS equal to PAD). No mask keeps SDPA's is_causal.
        kpm = None if getattr(self.model, "pad_id", None) is None else torch.zeros_like(self.history, dtype=torch.bool)
        if self.seq2seq:
            return self.model.decode(self.history, self.memory, self.memory_mask, kpm)[:, -1]
        return self.model(self.history, kpm)[:, -1]

    def reorder(self, rows: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (beam search)."""
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, rows)
        if self.cache is not None:
            self.model.reorder_cache(self.cache, rows)
            return
        self.history = self.history.index_select(0, rows)
        if self.memory is not None:
            self.memory = self.memory.index_select(0, rows)


def _prepare(
    model: nn.Module, inputs: Tensor, cfg: GenerationConfig, k: int, pad: int | None,
    prompt_lengths: Tensor | None, src_padding_mask: Tensor | None,
) -> tuple[_Decoder, Tensor, Tensor]:
    """Encode (seq2seq) and build the decoder for ``k`` rows per input.

    Returns:
        the decoder, the prefix (B, Tp) (prompt, or the BOS column) and its lengths (B,).
    """
    B = inputs.shape[0]
    memory = mask = None
    if _is_seq2seq(model):
        if cfg.bos_id is None:
            raise TkError("encoder-decoder generation needs generate.bos_id (the first decoder token)")
        mask = model.src_padding_mask(inputs) if src_padding_mask is None else src_padding_mask
        memory = model.encode(inputs, mask).repeat_interleave(k, dim=0)  # (B*k, Ts, D)
        mask = None if mask is None else mask.repeat_interleave(k, dim=0)
        prefix = inputs.new_full((B, 1), cfg.bos_id)
        lengths = torch.ones(B, dtype=torch.long, device=inputs.device)
    else:
        prefix, lengths = inputs, _prompt_lengths(inputs, prompt_lengths, pad)
    capacity = int(lengths.max()) + cfg.max_len
    return _Decoder(model, B * k, capacity, cfg.use_cache, memory, mask), prefix, lengths


def _init_seqs(prefix: Tensor, lengths: Tensor, max_len: int, pad: int | None) -> tuple[Tensor, int, int]:
    """Whole sequences (R, end) holding the prompts, PAD elsewhere; the first position to
    generate for any row (``start``) and one past the last (``end``)."""
    end = int(lengths.max()) + max_len
    pad = 0 if pad is None else pad  # without a pad_id there is no EOS: every row fills max_len
    seqs = prefix.new_full((prefix.shape[0], end), pad)
    seqs[:, : prefix.shape[1]] = prefix
    seqs[torch.arange(end, device=prefix.device) >= lengths[:, None]] = pad
    return seqs, int(lengths.min()), end


def _window(seqs: Tensor, lengths: Tensor, max_len: int) -> Tensor:
    """The generated part of each row: (R, end) -> (R, max_len)."""
    idx = lengths[:, None] + torch.arange(max_len, device=seqs.device)
    return seqs.gather(1, idx)


def _next_log_probs(logits: Tensor, step: Tensor, cfg: GenerationConfig, pad: int | None) -> Tensor:
    """(R, V) log-probs in float32; PAD is never generated (it only follows EOS), and EOS is
    blocked for rows that generated fewer than min_len. Blocking happens after the softmax,
    so the other tokens keep the model's log-probabilities."""
    logp = logits.float().log_softmax(dim=-1)
    if pad is not None and pad != cfg.eos_id:
        logp[:, pad] = _NEG_INF
    if cfg.eos_id is not None and cfg.min_len > 0:
        block = (step >= 0) & (step < cfg.min_len)
        logp[:, cfg.eos_id] = logp[:, cfg.eos_id].masked_fill(block, _NEG_INF)
    return logp


def _normalise(log_probs: Tensor, lengths: Tensor, alpha: float) -> Tensor:
    return log_probs / lengths.clamp(min=1).float() ** alpha


# ----------------------------------------------------------------------------- searches


def _decode_single(
    dec: _Decoder, prefix: Tensor, lengths: Tensor, cfg: GenerationConfig, pad: int | None,
    pick: Callable[[Tensor], Tensor],
) -> GenerationOutput:
    """Greedy or sampling: one hypothesis per row, ``pick`` maps (B, V) log-probs to (B,) ids."""
    B = prefix.shape[0]
    seqs, start, end = _init_seqs(prefix, lengths, cfg.max_len, pad)
    fill = torch.full_like(seqs[:, 0], 0 if pad is None else pad)
    log_probs = torch.zeros(B, device=prefix.device)
    gen_len = torch.zeros(B, dtype=torch.long, device=prefix.device)
    done = torch.zeros(B, dtype=torch.bool, device=prefix.device)
    logits = dec.feed(seqs[:, :start])  # prefill the prefix every row shares
    for p in range(start, end):
        step = p - lengths  # index of the token generated at position p; < 0 inside the prompt
        logp = _next_log_probs(logits, step, cfg, pad)
        active = (step >= 0) & ~done
        forced = torch.where(step < 0, seqs[:, p], fill)  # the prompt token, or PAD after the end
        tok = torch.where(active, pick(logp), forced)
        log_probs += torch.where(active, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        gen_len += active.long()
        seqs[:, p] = tok
        ended = step + 1 >= cfg.max_len
        if cfg.eos_id is not None:
            ended = ended | tok.eq(cfg.eos_id)
        done |= active & ended
        if p + 1 == end or bool(done.all()):
            break
        logits = dec.feed(tok[:, None])
    tokens = _window(seqs, lengths, cfg.max_len)[:, : int(gen_len.max())]
    return GenerationOutput(tokens, _normalise(log_probs, gen_len, cfg.length_penalty), log_probs, gen_len)


@dataclass
class _Finished:
    """The best K finished hypotheses of each batch item, best first (-inf = empty slot)."""

    scores: Tensor  # (B, K) normalised
    log_probs: Tensor  # (B, K)
    lengths: Tensor  # (B, K)
    tokens: Tensor  # (B, K, L)

    @classmethod
    def empty(cls, B: int, K: int, L: int, pad: int, like: Tensor) -> _Finished:
        scores = torch.full((B, K), _NEG_INF, device=like.device)
        lengths = torch.zeros(B, K, dtype=torch.long, device=like.device)
        return cls(scores, scores.clone(), lengths, like.new_full((B, K, L), pad))

    def add(self, scores: Tensor, log_probs: Tensor, lengths: Tensor, tokens: Tensor) -> None:
        """Merge candidates (B, C[, L]) whose scores are -inf unless they finish; keep the best K."""
        K, L = self.scores.shape[1], self.tokens.shape[2]
        self.scores, idx = torch.cat([self.scores, scores], dim=1).topk(K, dim=1)
        self.log_probs = torch.cat([self.log_probs, log_probs], dim=1).gather(1, idx)
        self.lengths = torch.cat([self.lengths, lengths], dim=1).gather(1, idx)
        self.tokens = torch.cat([self.tokens, tokens], dim=1).gather(1, idx[..., None].expand(-1, -1, L))

    def beaten_by_none(self, open_log_probs: Tensor, step: Tensor, cfg: GenerationConfig) -> Tensor:
        """(B,) True where K hypotheses are finished and no open beam can still beat the worst.

        Log-probs only fall as a beam grows, so its best reachable score is its current
        log-prob divided by the next or the largest length (whichever is better for alpha).
        """
        best = open_log_probs.max(dim=1).values  # (B,)
        alpha = cfg.length_penalty
        bound = torch.maximum(best / (step + 2).clamp(min=1).float() ** alpha, best / float(cfg.max_len) ** alpha)
        worst = self.scores[:, -1]
        return (worst > _NEG_INF) & (bound <= worst)


def _beam_search(
    dec: _Decoder, prefix: Tensor, lengths: Tensor, cfg: GenerationConfig, pad: int | None
) -> GenerationOutput:
    """Batched beam search over (B x K) rows; the cache is reordered every step."""
    B, K, L, dev = prefix.shape[0], cfg.beam_size, cfg.max_len, prefix.device
    seqs, start, end = _init_seqs(prefix.repeat_interleave(K, 0), lengths.repeat_interleave(K, 0), L, pad)
    beam_lp = torch.full((B, K), _NEG_INF, device=dev)
    beam_lp[:, 0] = 0.0  # the K rows start identical: expand only the first
    finished = _Finished.empty(B, K, L, 0 if pad is None else pad, prefix)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    base, keep = torch.arange(B, device=dev)[:, None] * K, torch.arange(K, device=dev).expand(B, K)
    logits = dec.feed(seqs[:, :start])
    for p in range(start, end):
        step = p - lengths  # (B,)
        logp = _next_log_probs(logits, step.repeat_interleave(K), cfg, pad).view(B, K, -1)
        V = logp.shape[-1]
        # 2K candidates: even if K of them end here, K open beams remain.
        cand_lp, flat = (beam_lp[..., None] + logp).view(B, K * V).topk(min(2 * K, K * V), dim=1)
        cand_beam, cand_tok = flat // V, flat % V
        last = (step + 1 >= L)[:, None]
        ending = last | cand_tok.eq(cfg.eos_id) if cfg.eos_id is not None else last.expand_as(cand_tok)
        # Only the top K candidates may finish (fairseq's rule; it makes beam_size=1 greedy).
        rank_ok = torch.arange(cand_tok.shape[1], device=dev) < K
        finishing = ending & rank_ok & (~done & (step >= 0))[:, None]
        if bool(finishing.any()):
            _add_finished(finished, seqs, lengths, cfg, base + cand_beam, cand_tok, cand_lp, finishing, step)
        open_lp, pick = cand_lp.masked_fill(ending, _NEG_INF).topk(K, dim=1)
        in_prompt = (step < 0)[:, None]  # these rows keep their beams and take the prompt token
        beam = torch.where(in_prompt, keep, cand_beam.gather(1, pick))
        rows = (base + beam).view(-1)
        seqs = seqs.index_select(0, rows)
        tok = torch.where(in_prompt, seqs[:, p].view(B, K), cand_tok.gather(1, pick))
        seqs[:, p] = tok.view(-1)
        beam_lp = torch.where(in_prompt, beam_lp, open_lp)
        done |= (step >= 0) & (last.squeeze(1) | finished.beaten_by_none(beam_lp, step, cfg))
        if p + 1 == end or bool(done.all()):
            break
        dec.reorder(rows)
        logits = dec.feed(seqs[:, p : p + 1])
    T = int(finished.lengths.max())
    return GenerationOutput(
        finished.tokens[:, 0, :T], finished.scores[:, 0], finished.log_probs[:, 0], finished.lengths[:, 0],
        beam_tokens=finished.tokens[:, :, :T], beam_scores=finished.scores,
    )


def _add_finished(
    finished: _Finished, seqs: Tensor, lengths: Tensor, cfg: GenerationConfig, rows: Tensor, tok: Tensor,
    cand_lp: Tensor, finishing: Tensor, step: Tensor,
) -> None:
    """Store the finishing candidates (B, C): history of row ``rows`` plus token ``tok``."""
    B, C = tok.shape
    K = seqs.shape[0] // B
    window = _window(seqs, lengths.repeat_interleave(K), cfg.max_len)  # (B*K, L)
    tokens = window.index_select(0, rows.view(-1)).view(B, C, -1)
    col = step.clamp(0, cfg.max_len - 1)[:, None, None].expand(B, C, 1)  # rows not finishing: any column
    tokens = tokens.scatter(2, col, tok[..., None])
    length = (step + 1).clamp(min=1)[:, None].expand(B, C)
    log_probs = cand_lp.masked_fill(~finishing, _NEG_INF)
    finished.add(_normalise(log_probs, length, cfg.length_penalty), log_probs, length, tokens)


# ----------------------------------------------------------------------------- entry points


def generate(
    model: nn.Module,
    inputs: Tensor,
    cfg: GenerationConfig | None = None,
    *,
    prompt_lengths: Tensor | None = None,
    src_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> GenerationOutput:
    """Generate with ``cfg.strategy`` ("greedy", "beam" or "sample"), under ``torch.no_grad``.

    Args:
        model: a ``DecoderOnlyLM`` or ``EncoderDecoder`` (or a model with their API), in eval mode.
        inputs: (B, Tp) right-padded LM prompts, or (B, Ts) source ids of an encoder-decoder.
        cfg: the settings; default ``GenerationConfig()``.
        prompt_lengths: (B,) LM prompt lengths; default from ``pad_id`` (else all Tp).
        src_padding_mask: (B, Ts) bool, True at source padding; default from ``model.pad_id``.
        generator: sampling RNG (overrides ``cfg.seed``).

    Returns:
        :class:`GenerationOutput`.

    Raises:
        TkError: on invalid settings (or a missing ``bos_id`` for an encoder-decoder, or a
            missing ``pad_id`` when ``eos_id`` is set).
        ValueError / TypeError: on bad inputs, a model in training mode or without the API.
    """
    cfg = GenerationConfig() if cfg is None else cfg
    _check_config(cfg)
    _check_model(model, inputs)
    pad = cfg.pad_id if cfg.pad_id is not None else getattr(model, "pad_id", None)
    if pad is None and cfg.eos_id is not None:
        raise TkError("generation with eos_id needs a pad_id to fill positions after EOS: set generate.pad_id")
    k = cfg.beam_size if cfg.strategy == "beam" else 1
    with torch.no_grad():
        dec, prefix, lengths = _prepare(model, inputs, cfg, k, pad, prompt_lengths, src_padding_mask)
        if cfg.strategy == "beam":
            return _beam_search(dec, prefix, lengths, cfg, pad)
        if cfg.strategy == "sample":
            if generator is None and cfg.seed is not None:
                generator = torch.Generator(inputs.device).manual_seed(cfg.seed)
            pick = partial(sample_next, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                           generator=generator)
        else:
            pick = partial(torch.argmax, dim=-1)
        return _decode_single(dec, prefix, lengths, cfg, pad, pick)


def greedy_decode(model: nn.Module, inputs: Tensor, **options) -> GenerationOutput:
    """Greedy search: :func:`generate` with ``strategy="greedy"``; ``options`` are
    :class:`GenerationConfig` fields (max_len, eos_id, pad_id, bos_id, use_cache, ...)
    or the keyword arguments of :func:`generate`."""
    return _run("greedy", model, inputs, options)


def beam_search(
    model: nn.Module, inputs: Tensor, beam_size: int = 4, length_penalty: float = 1.0, **options
) -> GenerationOutput:
    """Beam search: :func:`generate` with ``strategy="beam"``. Each batch item keeps
    ``beam_size`` open beams; a beam ending in EOS (or at max_len) becomes a finished
    hypothesis with score ``log_prob / length**length_penalty`` and keeps it; the search
    stops once every item has ``beam_size`` finished hypotheses that no open beam can beat.
    With ``length_penalty > 0`` a finished hypothesis does not stop a beam that could still
    score better when longer, so ``beam_size=1`` equals greedy only for ``length_penalty=0``."""
    return _run("beam", model, inputs, dict(options, beam_size=beam_size, length_penalty=length_penalty))


def sample(
    model: nn.Module, inputs: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None, **options,
) -> GenerationOutput:
    """Ancestral sampling: :func:`generate` with ``strategy="sample"`` (see :func:`sample_next`).
    ``temperature=0`` or ``top_k=1`` gives the greedy tokens."""
    options = dict(options, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    return _run("sample", model, inputs, options)


def _run(strategy: str, model: nn.Module, inputs: Tensor, options: dict) -> GenerationOutput:
    call_keys = ("prompt_lengths", "src_padding_mask", "generator")
    call = {key: options.pop(key) for key in call_keys if key in options}
    return generate(model, inputs, GenerationConfig(strategy=strategy, **options), **call)
