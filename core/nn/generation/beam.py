"""Batched beam search over (B x K) rows with a finished-hypothesis pool, fairseq-style.

Papers: beam search for NMT, "Sequence to Sequence Learning with Neural Networks"
(Sutskever et al., 2014), https://arxiv.org/abs/1409.3215; length normalisation, GNMT
(Wu et al., 2016), https://arxiv.org/abs/1609.08144 (we use fairseq's simpler
``score / len**alpha``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tk.core.nn.generation import decoding
from tk.core.nn.generation.decoding import NEG_INF, Decoder, GenerationConfig, GenerationOutput


@dataclass
class _Finished:
    """The best K finished hypotheses of each batch item, best first (-inf = empty slot)."""

    scores: Tensor  # (B, K) normalised
    log_probs: Tensor  # (B, K)
    lengths: Tensor  # (B, K)
    tokens: Tensor  # (B, K, L)

    @classmethod
    def empty(cls, B: int, K: int, L: int, pad: int, like: Tensor) -> _Finished:
        scores = torch.full((B, K), NEG_INF, device=like.device)
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
        ``beam_stop="heuristic"`` divides by its current length instead (transformers' default,
        ``early_stopping=False``: it may stop before a longer beam would have won).
        """
        best = open_log_probs.max(dim=1).values  # (B,)
        alpha = cfg.length_penalty
        if cfg.beam_stop == "heuristic":
            bound = best / (step + 1).clamp(min=1).float() ** alpha
        else:
            bound = torch.maximum(best / (step + 2).clamp(min=1).float() ** alpha, best / float(cfg.max_len) ** alpha)
        worst = self.scores[:, -1]
        return (worst > NEG_INF) & (bound <= worst)


def run_beam_search(
    dec: Decoder, prefix: Tensor, lengths: Tensor, cfg: GenerationConfig, pad: int | None
) -> GenerationOutput:
    """Batched beam search over (B x K) rows; the cache is reordered every step."""
    B, K, L, dev = prefix.shape[0], cfg.beam_size, cfg.max_len, prefix.device
    seqs, start, end = decoding.init_seqs(prefix.repeat_interleave(K, 0), lengths.repeat_interleave(K, 0), L, pad)
    beam_lp = torch.full((B, K), NEG_INF, device=dev)
    beam_lp[:, 0] = 0.0  # the K rows start identical: expand only the first
    finished = _Finished.empty(B, K, L, 0 if pad is None else pad, prefix)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    base, keep = torch.arange(B, device=dev)[:, None] * K, torch.arange(K, device=dev).expand(B, K)
    logits = dec.feed(seqs[:, :start])
    for p in range(start, end):
        step = p - lengths  # (B,)
        logp = decoding.next_log_probs(logits, step.repeat_interleave(K), cfg, pad).view(B, K, -1)
        V = logp.shape[-1]
        # 2K candidates: even if K of them end here, K open beams remain.
        cand_lp, flat = (beam_lp[..., None] + logp).view(B, K * V).topk(min(2 * K, K * V), dim=1)
        cand_beam, cand_tok = flat // V, flat % V
        last = (step + 1 >= L)[:, None]
        ending = last | cfg.is_stop(cand_tok) if cfg.stop_ids else last.expand_as(cand_tok)
        # Only the top K candidates may finish (fairseq's rule; it makes beam_size=1 greedy).
        rank_ok = torch.arange(cand_tok.shape[1], device=dev) < K
        finishing = ending & rank_ok & (~done & (step >= 0))[:, None]
        if bool(finishing.any()):
            _add_finished(finished, seqs, lengths, cfg, base + cand_beam, cand_tok, cand_lp, finishing, step)
        open_lp, pick = cand_lp.masked_fill(ending, NEG_INF).topk(K, dim=1)
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
    history = decoding.generated_window(seqs, lengths.repeat_interleave(K), cfg.max_len)  # (B*K, L)
    tokens = history.index_select(0, rows.view(-1)).view(B, C, -1)
    col = step.clamp(0, cfg.max_len - 1)[:, None, None].expand(B, C, 1)  # rows not finishing: any column
    tokens = tokens.scatter(2, col, tok[..., None])
    length = (step + 1).clamp(min=1)[:, None].expand(B, C)
    log_probs = cand_lp.masked_fill(~finishing, NEG_INF)
    finished.add(decoding.normalise(log_probs, length, cfg.length_penalty), log_probs, length, tokens)
