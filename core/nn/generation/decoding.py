"""Decoding state shared by the searches of :mod:`tk.core.nn.generation`: the settings, the
output, the token filters of sampling, the model feeder (cached or recomputing) and the
bookkeeping of whole sequences.

Papers: top-k sampling (Fan et al., 2018), https://arxiv.org/abs/1805.04833; nucleus (top-p)
sampling (Holtzman et al., 2020), https://arxiv.org/abs/1904.09751.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

STRATEGIES = ("greedy", "beam", "sample")
NEG_INF = float("-inf")


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
    compile: bool = False  # torch.compile the cached decode step (pays off for long generations; compiles once)
    bos_id: int | None = None  # first decoder token of an encoder-decoder (required there)
    eos_id: int | None = None  # token that ends a sequence; None = always generate max_len tokens
    eos_ids: list[int] | None = None  # more tokens that end a sequence (Llama 3 Instruct's <|eot_id|> beside <|end_of_text|>)
    pad_id: int | None = None  # fills positions after EOS and pads LM prompts; None = model.pad_id
    forced_bos_id: int | None = None  # the first generated token, forced (NLLB, mBART: the target language code)
    forced_eos: bool = False  # the last allowed token (the max_len-th) is eos_id, forced (Marian's forced_eos_token_id)
    beam_stop: Literal["bound", "heuristic"] = "bound"  # beam: stop an input once no open beam can beat its K finished ones at any length up to max_len (bound) or at its current length (heuristic: transformers' default)

    @property
    def stop_ids(self) -> list[int]:
        """Every token that ends a sequence: ``eos_id`` then ``eos_ids`` (empty: none does)."""
        ids = ([] if self.eos_id is None else [self.eos_id]) + list(self.eos_ids or [])
        return list(dict.fromkeys(ids))

    def is_stop(self, tokens: Tensor) -> Tensor:
        """Bool tensor: which of ``tokens`` end a sequence."""
        ids = self.stop_ids
        if len(ids) == 1:
            return tokens.eq(ids[0])
        return torch.isin(tokens, torch.tensor(ids, device=tokens.device, dtype=tokens.dtype))

    def check(self, prefix: str = "generate") -> list[str]:
        """Range checks, one line per broken rule, keys named as ``{prefix}.field``."""
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"{prefix}.strategy ({self.strategy!r}) must be one of {STRATEGIES}")
        if self.max_len < 1:
            problems.append(f"{prefix}.max_len ({self.max_len}) must be >= 1")
        if not 0 <= self.min_len <= self.max_len:
            problems.append(f"{prefix}.min_len ({self.min_len}) must be in [0, max_len ({self.max_len})]")
        if self.beam_size < 1:
            problems.append(f"{prefix}.beam_size ({self.beam_size}) must be >= 1")
        if self.temperature < 0:
            problems.append(f"{prefix}.temperature ({self.temperature}) must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            problems.append(f"{prefix}.top_k ({self.top_k}) must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"{prefix}.top_p ({self.top_p}) must be in (0, 1] (1 = off)")
        if self.forced_eos and self.eos_id is None:
            problems.append(f"{prefix}.forced_eos needs {prefix}.eos_id (the token it forces)")
        if self.beam_stop not in ("bound", "heuristic"):
            problems.append(f"{prefix}.beam_stop ({self.beam_stop!r}) must be 'bound' or 'heuristic'")
        return problems

    @property
    def forces(self) -> bool:
        """Whether some position has a forced token (:func:`force_tokens`)."""
        return self.forced_bos_id is not None or self.forced_eos


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



def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (exactly k), set the others to -inf.

    Args:
        logits: (..., V). k: tokens kept; ``k <= 0`` or ``k >= V`` returns ``logits`` unchanged.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, NEG_INF)


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
    return logits.masked_fill(drop, NEG_INF)


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



class Decoder:
    """Feeds token columns of R rows to a model and returns the next-token logits.

    Cached: ``decode_step`` on a KV cache. Uncached (the reference): the whole prefix runs
    through ``forward`` / ``decode`` again every step.
    """

    def __init__(
        self, model: nn.Module, rows: int, capacity: int, use_cache: bool,
        memory: Tensor | None = None, memory_key_padding_mask: Tensor | None = None, compile: bool = False,
    ) -> None:
        self.model, self.memory, self.memory_key_padding_mask = model, memory, memory_key_padding_mask
        self.seq2seq = memory is not None
        self.cache = model.init_cache(rows, capacity) if use_cache else None
        self.history: Tensor | None = None  # (R, t) tokens fed so far (uncached only)
        # dynamic=True: one graph for every cache length instead of a recompile per step
        self.step = torch.compile(model.decode_step, dynamic=True) if compile and use_cache else model.decode_step

    def feed(self, tokens: Tensor) -> Tensor:
        """tokens (R, Tn) at the next Tn positions -> logits (R, V) for the position after them."""
        if self.cache is not None:
            if self.seq2seq:
                logits = self.step(tokens, self.memory, self.memory_key_padding_mask, self.cache)
                self.memory = None  # cross-attention keys/values now live in the cache
            else:
                logits = self.step(tokens, self.cache)
            return logits.select(1, -1)
        self.history = tokens if self.history is None else torch.cat([self.history, tokens], dim=1)
        # The cached path masks no target key, so neither does the reference (a model with a
        # pad_id would otherwise mask, e.g., a BOS equal to PAD). No mask keeps SDPA's is_causal.
        kpm = None if getattr(self.model, "pad_id", None) is None else torch.zeros_like(self.history, dtype=torch.bool)
        if self.seq2seq:
            return self.model.decode(self.history, self.memory, self.memory_key_padding_mask, kpm)[:, -1]
        return self.model(self.history, kpm)[:, -1]

    def reorder(self, rows: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (beam search)."""
        if self.memory_key_padding_mask is not None:
            self.memory_key_padding_mask = self.memory_key_padding_mask.index_select(0, rows)
        if self.cache is not None:
            self.model.reorder_cache(self.cache, rows)
            return
        self.history = self.history.index_select(0, rows)
        if self.memory is not None:
            self.memory = self.memory.index_select(0, rows)



def init_seqs(prefix: Tensor, lengths: Tensor, max_len: int, pad: int | None) -> tuple[Tensor, int, int]:
    """Whole sequences (R, end) holding the prompts, PAD elsewhere; the first position to
    generate for any row (``start``) and one past the last (``end``)."""
    end = int(lengths.max()) + max_len
    pad = 0 if pad is None else pad  # without a pad_id there is no EOS: every row fills max_len
    seqs = prefix.new_full((prefix.shape[0], end), pad)
    seqs[:, : prefix.shape[1]] = prefix
    seqs[torch.arange(end, device=prefix.device) >= lengths[:, None]] = pad
    return seqs, int(lengths.min()), end


def generated_window(seqs: Tensor, lengths: Tensor, max_len: int) -> Tensor:
    """The generated part of each row: (R, end) -> (R, max_len)."""
    idx = lengths[:, None] + torch.arange(max_len, device=seqs.device)
    return seqs.gather(1, idx)


def next_log_probs(logits: Tensor, step: Tensor, cfg: GenerationConfig, pad: int | None) -> Tensor:
    """(R, V) log-probs in float32; PAD is never generated (it only follows EOS), and EOS is
    blocked for rows that generated fewer than min_len. Blocking happens after the softmax,
    so the other tokens keep the model's log-probabilities."""
    logp = logits.float().log_softmax(dim=-1)
    if pad is not None and pad not in cfg.stop_ids:
        logp[:, pad] = NEG_INF
    if cfg.stop_ids and cfg.min_len > 0:
        block = (step >= 0) & (step < cfg.min_len)
        for eos in cfg.stop_ids:
            logp[:, eos] = logp[:, eos].masked_fill(block, NEG_INF)
    return force_tokens(logp, step, cfg) if cfg.forces else logp


def force_tokens(logp: Tensor, step: Tensor | int, cfg: GenerationConfig) -> Tensor:
    """transformers' forced tokens, in place: rows at their first generated token (``step`` 0)
    can only take ``forced_bos_id``, rows at their last allowed one (``max_len - 1``) only EOS;
    the forced token gets log-prob 0, as there. ``logp`` (R, V); ``step`` (R,) or one int for all."""
    for token, at in ((cfg.forced_bos_id, 0), (cfg.eos_id if cfg.forced_eos else None, cfg.max_len - 1)):
        if token is None:
            continue
        forced = torch.full_like(logp[0], NEG_INF)
        forced[token] = 0.0
        if isinstance(step, int):
            if step == at:
                logp.copy_(forced.expand_as(logp))
        else:
            logp.copy_(torch.where(step.eq(at)[:, None], forced, logp))
    return logp


def normalise(log_probs: Tensor, lengths: Tensor, alpha: float) -> Tensor:
    return log_probs / lengths.clamp(min=1).float() ** alpha
