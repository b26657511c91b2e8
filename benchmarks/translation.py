"""Benchmark: the translation plugin's model (``tk.core.nn.transformer.EncoderDecoder``).

1. Training tokens/s against ``torch.nn.Transformer`` of the same size: same width, layers,
   heads, feed-forward width, activation, pre-norm with final norms, dropout; the same
   shared (source = target = output) embedding scaled by sqrt(D), sinusoidal positions and
   embedding dropout built around it (``ReferenceSeq2Seq`` below). Both get the same
   token-budget batches (random ids with sentence-like lengths, right-padded, bucketed by
   core's ``TokenBudgetBatchSampler``), the same masks (source padding on encoder
   self-attention and cross-attention, causal decoder self-attention; right-padded targets
   need no target padding mask under the causal mask, for either model), the same
   label-smoothed loss and the same Adam. Variants run interleaved (random order per
   repetition); medians over repetitions. Target: tk / nn.Transformer >= 1.0.
2. Beam-4 decoding sentences/s with and without the KV cache (``tk.core.nn.generation``),
   every output exactly ``--out-len`` tokens (EOS blocked until then). Target: cache >= 3x
   at 30-token outputs. Checks that both give the same tokens.

    python benchmarks/translation.py --quick      # smoke run (seconds)
    python benchmarks/translation.py              # full run (OMP_NUM_THREADS=2, under the lock)

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
import warnings

import numpy as np
import torch
from torch import Tensor, nn

from tk.core.data.samplers import TokenBudgetBatchSampler
from tk.core.losses import cross_entropy_sum
from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.nn.transformer import EncoderDecoder
from tk.plugins.translation.data import collate_pairs

PAD, BOS, EOS = 0, 1, 2


class ReferenceSeq2Seq(nn.Module):
    """``nn.Transformer`` with the plugin model's embeddings and output projection around it."""

    def __init__(self, cfg: TransformerConfig, vocab: int) -> None:
        super().__init__()
        self.dim = cfg.dim
        self.embed = nn.Embedding(vocab, cfg.dim, padding_idx=PAD)
        pos = torch.arange(cfg.max_len).unsqueeze(1) * torch.exp(
            torch.arange(0, cfg.dim, 2) * (-math.log(10000.0) / cfg.dim))
        table = torch.zeros(cfg.max_len, cfg.dim)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("pos", table, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        # nested tensors are off for norm_first encoders anyway; the warning says only that
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        self.transformer = nn.Transformer(
            cfg.dim, cfg.num_heads, cfg.depth, cfg.depth, cfg.ffn_dim, cfg.dropout, activation=cfg.activation,
            batch_first=True, norm_first=cfg.norm_first,
        )
        self.lm_head = nn.Linear(cfg.dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def _embed(self, ids: Tensor) -> Tensor:
        return self.drop(self.embed(ids) * self.dim**0.5 + self.pos[: ids.shape[1]])

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        pad = src.eq(PAD)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=torch.bool)
        y = self.transformer(self._embed(src), self._embed(tgt), tgt_mask=causal, src_key_padding_mask=pad,
                             memory_key_padding_mask=pad, tgt_is_causal=True)
        return self.lm_head(y)


def make_batches(num_pairs: int, vocab: int, max_tokens: int, seed: int) -> list[dict[str, Tensor]]:
    """Token-budget batches of random pairs with sentence-like lengths (BOS/EOS included)."""
    rng = np.random.default_rng(seed)
    src_len = rng.integers(8, 40, num_pairs)
    tgt_len = np.clip(src_len + rng.integers(-3, 6, num_pairs), 4, None)
    samples = [{"id": i, "src": torch.cat([torch.randint(4, vocab, (int(s) - 1,)), torch.tensor([EOS])]),
                "tgt": torch.cat([torch.tensor([BOS]), torch.randint(4, vocab, (int(t) - 2,)), torch.tensor([EOS])])}
               for i, (s, t) in enumerate(zip(src_len, tgt_len))]
    lengths = np.stack([src_len, tgt_len], 1)
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, shuffle=True, seed=seed)
    return [collate_pairs([samples[i] for i in idx], PAD) for idx in sampler]


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[dict[str, Tensor]]) -> float:
    """Seconds for one update per batch."""
    t0 = time.perf_counter()
    for b in batches:
        loss, n = cross_entropy_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], label_smoothing=0.1, ignore_index=PAD)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def bench_training(cfg: TransformerConfig, vocab: int, batches: list, reps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    models = {"tk": EncoderDecoder(cfg, vocab, vocab, pad_id=PAD), "nn.Transformer": ReferenceSeq2Seq(cfg, vocab)}
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    assert counts["tk"] == counts["nn.Transformer"], f"models differ in size: {counts}"
    opts = {k: torch.optim.Adam(m.parameters(), 1e-4, betas=(0.9, 0.98), eps=1e-9) for k, m in models.items()}
    tokens = sum(int(b["tgt_out"].ne(PAD).sum()) for b in batches)
    for k, m in models.items():
        m.train()
        train_steps(m, opts[k], batches[:warmup])
    times: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for _ in range(reps):
        random.shuffle(order)
        for k in order:
            times[k].append(train_steps(models[k], opts[k], batches))
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    return {"params": counts["tk"], "batches": len(batches), "target_tokens": tokens, "tokens_per_s": tps,
            "ratio": tps["tk"] / tps["nn.Transformer"]}


@torch.no_grad()
def bench_decoding(cfg: TransformerConfig, vocab: int, batch: int, src_len: int, out_len: int, reps: int) -> dict:
    torch.manual_seed(1)
    model = EncoderDecoder(cfg, vocab, vocab, pad_id=PAD).eval()
    src = torch.randint(4, vocab, (batch, src_len))
    src[: batch // 2, -src_len // 4:] = PAD  # half the rows padded
    src[:, -1] = torch.where(src[:, -1].eq(PAD), PAD, EOS)
    gen = {c: GenerationConfig(strategy="beam", beam_size=4, max_len=out_len, min_len=out_len, bos_id=BOS,
                               eos_id=EOS, pad_id=PAD, use_cache=c) for c in (True, False)}
    outs = {c: generate(model, src, g).tokens for c, g in gen.items()}  # warm-up and correctness
    times: dict[bool, list[float]] = {True: [], False: []}
    order = [True, False]
    for _ in range(reps):
        random.shuffle(order)
        for c in order:
            t0 = time.perf_counter()
            generate(model, src, gen[c])
            times[c].append(time.perf_counter() - t0)
    sps = {("cached" if c else "uncached"): batch / statistics.median(v) for c, v in times.items()}
    return {"sentences_per_s": sps, "ratio": sps["cached"] / sps["uncached"],
            "tokens_equal": bool(torch.equal(outs[True], outs[False])), "out_len": int(outs[True].shape[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run of seconds)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--steps", type=int, default=None, help="training batches per repetition (default 6; quick 3)")
    p.add_argument("--part", choices=("all", "train", "decode"), default="all", help="which measurement(s) to run")
    p.add_argument("--out-len", type=int, default=30, help="decoded tokens per sentence")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(0)
    if args.quick:
        cfg = TransformerConfig(dim=64, depth=1, num_heads=4, hidden_dim=128, dropout=0.1, max_len=128,
                                share_embeddings=True)
        vocab, pairs, max_tokens, steps, warmup, dec_batch, out_len = 500, 200, 512, 3, 1, 4, min(args.out_len, 8)
    else:  # the Multi30k CPU recipe's model and batch size
        cfg = TransformerConfig(dim=256, depth=3, num_heads=4, hidden_dim=1024, dropout=0.1, max_len=256,
                                share_embeddings=True)
        vocab, pairs, max_tokens, steps, warmup, dec_batch, out_len = 8000, 2000, 2048, 6, 1, 16, args.out_len
    batches = make_batches(pairs, vocab, max_tokens, seed=0)[: args.steps or steps]
    nan = float("nan")
    train = (bench_training(cfg, vocab, batches, args.reps, warmup) if args.part != "decode" else
             {"params": sum(p.numel() for p in EncoderDecoder(cfg, vocab, vocab).parameters()), "batches": 0,
              "target_tokens": 0, "tokens_per_s": {"tk": nan, "nn.Transformer": nan}, "ratio": nan})
    dec = (bench_decoding(cfg, vocab, dec_batch, 24, out_len, args.reps) if args.part != "train" else
           {"sentences_per_s": {"cached": nan, "uncached": nan}, "ratio": nan, "tokens_equal": None, "out_len": 0})
    print(f"model: dim {cfg.dim}, {cfg.depth}+{cfg.depth} layers, {cfg.num_heads} heads, ffn {cfg.ffn_dim}, "
          f"vocab {vocab} (shared), {train['params']:,} parameters; threads {torch.get_num_threads()}")
    print(f"training: {train['batches']} batches of <= {max_tokens} padded tokens, {train['target_tokens']} target "
          f"tokens per repetition, {args.reps} repetitions (medians)")
    print(f"{'variant':<28}{'value':>14}")
    for k, v in train["tokens_per_s"].items():
        print(f"{'train tokens/s ' + k:<28}{v:>14.0f}")
    print(f"{'train ratio tk/nn':<28}{train['ratio']:>14.2f}")
    for k, v in dec["sentences_per_s"].items():
        print(f"{'beam-4 sent/s ' + k:<28}{v:>14.2f}")
    print(f"{'beam-4 cache speed-up':<28}{dec['ratio']:>14.2f}   ({dec['out_len']}-token outputs, "
          f"batch {dec_batch}, tokens equal: {dec['tokens_equal']})")
    def r(x: float, digits: int) -> float | None:  # null for a part that was not run
        return None if math.isnan(x) else round(x, digits)

    print(json.dumps({
        "benchmark": "translation", "quick": args.quick, "threads": torch.get_num_threads(),
        "train_tokens_per_s_tk": r(train["tokens_per_s"]["tk"], 1),
        "train_tokens_per_s_nn_transformer": r(train["tokens_per_s"]["nn.Transformer"], 1),
        "train_ratio": r(train["ratio"], 3),
        "beam4_sent_per_s_cached": r(dec["sentences_per_s"]["cached"], 3),
        "beam4_sent_per_s_uncached": r(dec["sentences_per_s"]["uncached"], 3),
        "cache_speedup": r(dec["ratio"], 3), "out_len": dec["out_len"], "tokens_equal": dec["tokens_equal"],
    }))


if __name__ == "__main__":
    main()
