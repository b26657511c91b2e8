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
  (or pass ``src_key_padding_mask``). The source is encoded once, the decoder starts from
  ``bos_id``, and the cross-attention keys/values are computed once (by the cache).

Output: only generated tokens (no prompt, no BOS), (B, T) with T <= max_len. A sequence
ends with EOS (kept) and every later position is PAD; a sequence without EOS stops at
``max_len``. ``scores`` are ``log_probs / length**length_penalty`` for every strategy,
where ``log_probs`` sums the model's log-probabilities (temperature 1) of the generated
tokens, EOS included, and ``length`` counts them.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from typing import Callable

import torch
from torch import Tensor, nn

from tk.core.errors import TkError
from tk.core.nn.generation.beam import run_beam_search
from tk.core.nn.generation.decoding import (
    NEG_INF,
    Decoder,
    GenerationConfig,
    GenerationOutput,
    generated_window,
    init_seqs,
    force_tokens,
    normalise,
    sample_next,
)

__all__ = [
    "GenerationConfig", "GenerationOutput", "generate", "greedy_decode", "beam_search", "sample",
    "sample_next",
]


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



def _prepare(
    model: nn.Module, inputs: Tensor, cfg: GenerationConfig, k: int, pad: int | None,
    prompt_lengths: Tensor | None, src_key_padding_mask: Tensor | None,
) -> tuple[Decoder, Tensor, Tensor]:
    """Encode (seq2seq) and build the decoder for ``k`` rows per input.

    Returns:
        the decoder, the prefix (B, Tp) (prompt, or the BOS column) and its lengths (B,).
    """
    B = inputs.shape[0]
    memory = mask = None
    if _is_seq2seq(model):
        if cfg.bos_id is None:
            raise TkError("encoder-decoder generation needs generate.bos_id (the first decoder token)")
        mask = model.src_key_padding_mask(inputs) if src_key_padding_mask is None else src_key_padding_mask
        memory = model.encode(inputs, mask).repeat_interleave(k, dim=0)  # (B*k, Ts, D)
        mask = None if mask is None else mask.repeat_interleave(k, dim=0)
        prefix = inputs.new_full((B, 1), cfg.bos_id, dtype=torch.long)
        lengths = torch.ones(B, dtype=torch.long, device=inputs.device)
    else:
        prefix, lengths = inputs.long(), _prompt_lengths(inputs, prompt_lengths, pad)  # int32 prompts too
    capacity = int(lengths.max()) + cfg.max_len
    return Decoder(model, B * k, capacity, cfg.use_cache, memory, mask, cfg.compile), prefix, lengths



def _mask_in_place(scores: Tensor, p: int, lengths: Tensor, longest: int, cfg: GenerationConfig,
                   pad: int | None) -> None:
    """PAD is never generated (it only follows EOS); EOS is blocked for rows that generated
    fewer than ``min_len`` tokens. ``scores`` (R, V) are logits or log-probs of position ``p``."""
    if pad is not None and pad not in cfg.stop_ids:
        scores[:, pad] = NEG_INF
    if cfg.stop_ids and cfg.min_len > 0 and p < longest + cfg.min_len:
        step = p - lengths
        for eos in cfg.stop_ids:
            scores[:, eos] = scores[:, eos].masked_fill((step >= 0) & (step < cfg.min_len), NEG_INF)


def _decode_single(
    dec: Decoder, prefix: Tensor, lengths: Tensor, cfg: GenerationConfig, pad: int | None,
    pick: Callable[[Tensor], Tensor] | None, on_step: Callable[[int, Tensor], None] | None = None,
) -> GenerationOutput:
    """Greedy (``pick`` None) or sampling: one hypothesis per row; ``pick`` maps (R, V)
    log-probs to (R,) ids.

    The loop does the least per step: tokens go straight into a preallocated (end, R)
    buffer (position p is one contiguous row), greedy takes token and log-prob with one
    ``max`` of the log-softmax, and prompt forcing runs only while some row is still inside its prompt. What
    depends on EOS (the PAD after it, the lengths, the summed log-probs) is computed once
    after the loop; a row that ended keeps feeding its own tokens (rows are independent,
    and everything after its EOS is replaced by PAD), so no per-step fill is needed.
    """
    B, device = prefix.shape[0], prefix.device
    seqs, start, end = init_seqs(prefix, lengths, cfg.max_len, pad)
    longest, stops = int(lengths.max()), cfg.stop_ids
    cols = seqs.t().contiguous()  # (end, R): the token at every position
    tok_logp = torch.zeros(end, B, device=device)  # log-prob of the token at every position
    done = torch.zeros(B, dtype=torch.bool, device=device) if stops else None
    # rows whose last allowed token (max_len) comes before the longest prompt's: done early
    finish: dict[int, Tensor] = {}
    if done is not None and start != longest:
        last = lengths + cfg.max_len - 1
        finish = {q: last.eq(q) for q in set(last.tolist()) if q < end - 1}
    masking = (pad is not None and pad not in stops) or (bool(stops) and cfg.min_len > 0)
    # Views of every position made once (a list lookup per step instead of an indexing op):
    # col_rows[p] (R,) the tokens at p, logp_rows[p] their log-probs, inputs[p] (R, 1) the decoder input.
    col_rows, logp_rows, inputs = cols.unbind(0), tok_logp.unbind(0), cols[:, :, None].unbind(0)
    logits = dec.feed(seqs[:, :start])  # prefill the prefix every row shares
    for p in range(start, end):
        forcing = p < longest  # some row is still inside its prompt
        logp = logits.float().log_softmax(dim=-1)  # one fused kernel; masks come after it (model's log-probs)
        if masking:
            _mask_in_place(logp, p, lengths, longest, cfg, pad)
        if cfg.forces:
            force_tokens(logp, p - start if start == longest else p - lengths, cfg)
        if pick is None:  # greedy: one max() gives the token and its log-prob
            if forcing:
                best, tok = logp.max(dim=-1)
                logp_rows[p].copy_(best)
            else:
                torch.max(logp, dim=-1, out=(logp_rows[p], col_rows[p]))
        else:
            tok = pick(logp)
            if not forcing:
                col_rows[p].copy_(tok)
            logp_rows[p].copy_(logp.gather(1, tok[:, None]).squeeze(1))
        if forcing:
            in_prompt = lengths > p
            col_rows[p].copy_(torch.where(in_prompt, col_rows[p], tok))
        if on_step is not None:
            with torch.inference_mode(False):  # an ordinary copy: the callback may keep or change it
                on_step(p - start, col_rows[p].clone())
        if done is not None:
            hit = cfg.is_stop(col_rows[p])
            done |= hit & ~in_prompt if forcing else hit
            if p in finish:
                done |= finish[p]
            if bool(done.all()):
                break
        if p + 1 < end:
            logits = dec.feed(inputs[p])
    return _finish(cols.t(), tok_logp.t(), lengths, cfg, pad)


def _finish(seqs: Tensor, tok_logp: Tensor, lengths: Tensor, cfg: GenerationConfig, pad: int | None
            ) -> GenerationOutput:
    """From whole sequences (R, end) and per-position log-probs: the generated windows with
    PAD after the first EOS, their lengths and summed log-probs."""
    tokens = generated_window(seqs, lengths, cfg.max_len)  # (R, max_len)
    logp = generated_window(tok_logp, lengths, cfg.max_len)
    gen_len = torch.full_like(lengths, cfg.max_len)
    if cfg.stop_ids:
        is_eos = cfg.is_stop(tokens)
        first = is_eos.int().argmax(dim=1)  # the first EOS (argmax returns the first maximum)
        gen_len = torch.where(is_eos.any(dim=1), first + 1, gen_len)
        after = torch.arange(cfg.max_len, device=tokens.device) >= gen_len[:, None]
        tokens = tokens.masked_fill(after, pad)
        logp = logp.masked_fill(after, 0.0)
    log_probs = logp.sum(dim=1)
    tokens = tokens[:, : int(gen_len.max())]
    return GenerationOutput(tokens, normalise(log_probs, gen_len, cfg.length_penalty), log_probs, gen_len)



def generate(
    model: nn.Module,
    inputs: Tensor,
    cfg: GenerationConfig | None = None,
    *,
    prompt_lengths: Tensor | None = None,
    src_key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[int, Tensor], None] | None = None,
) -> GenerationOutput:
    """Generate with ``cfg.strategy`` ("greedy", "beam" or "sample"), under ``torch.inference_mode``
    (the returned tensors, and those handed to ``on_step``, are ordinary ones unless the caller
    itself runs under ``inference_mode``).

    Args:
        model: a ``DecoderOnlyLM`` or ``EncoderDecoder`` (or a model with their API), in eval mode.
        inputs: (B, Tp) right-padded LM prompts, or (B, Ts) source ids of an encoder-decoder.
        cfg: the settings; default ``GenerationConfig()``.
        prompt_lengths: (B,) LM prompt lengths; default from ``pad_id`` (else all Tp).
        src_key_padding_mask: (B, Ts) bool, True at source padding; default from ``model.pad_id``.
        generator: sampling RNG (overrides ``cfg.seed``).
        on_step: streaming (greedy and sampling, not beam): called after every decoding
            step as ``on_step(i, tokens)`` with the (B,) ids just placed at the i-th position
            after the shortest prompt (a row still inside its prompt gets its prompt token;
            rows that already ended are not PAD-filled yet: the returned ``tokens`` are
            final). With equal prompt lengths ``i`` is the generated token's index.

    Returns:
        :class:`GenerationOutput`.

    Raises:
        TkError: on invalid settings (or a missing ``bos_id`` for an encoder-decoder, or a
            missing ``pad_id`` when ``eos_id`` is set).
        ValueError / TypeError: on bad inputs, a model in training mode or without the API.
    """
    cfg = GenerationConfig() if cfg is None else cfg
    problems = cfg.check()
    if problems:
        raise TkError("; ".join(problems))
    _check_model(model, inputs)
    pad = cfg.pad_id if cfg.pad_id is not None else getattr(model, "pad_id", None)
    if pad is None and cfg.stop_ids:
        raise TkError("generation with eos_id needs a pad_id to fill positions after EOS: set generate.pad_id")
    if on_step is not None and cfg.strategy == "beam":
        raise ValueError("on_step (streaming) works with strategy greedy or sample, not beam")
    k = cfg.beam_size if cfg.strategy == "beam" else 1
    # inference_mode, not no_grad: no version counters or autograd metadata on any op, which
    # is most of the per-token cost of a small model at batch 1 (measured ~8 % of a step).
    with torch.inference_mode():
        dec, prefix, lengths = _prepare(model, inputs, cfg, k, pad, prompt_lengths, src_key_padding_mask)
        if cfg.strategy == "beam":
            out = run_beam_search(dec, prefix, lengths, cfg, pad)
        else:
            if cfg.strategy == "sample":
                if generator is None and cfg.seed is not None:
                    generator = torch.Generator(inputs.device).manual_seed(cfg.seed)
                pick = partial(sample_next, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                               generator=generator)
            else:
                pick = None  # greedy: one max() per step gives the token and its logit
            out = _decode_single(dec, prefix, lengths, cfg, pad, pick, on_step)
    return _as_normal_tensors(out)


def _as_normal_tensors(out: GenerationOutput) -> GenerationOutput:
    """Copies of the outputs made outside inference mode: inference tensors cannot be saved
    for backward, so generated tokens fed to a model being trained (self-training, RL)
    would otherwise fail there."""
    values = {f.name: getattr(out, f.name) for f in fields(out)}
    return GenerationOutput(**{name: None if t is None else t.clone() for name, t in values.items()})


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
    call_keys = ("prompt_lengths", "src_key_padding_mask", "generator")
    call = {key: options.pop(key) for key in call_keys if key in options}
    return generate(model, inputs, GenerationConfig(strategy=strategy, **options), **call)
