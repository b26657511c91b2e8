"""Benchmark: tk attention vs F.scaled_dot_product_attention vs naive matmul-softmax-matmul,
plus cached vs uncached greedy generation.

Forward + backward time of causal self-attention at L in {64, 256, 1024}, all three
implementations interleaved in one run (random order per repetition), medians over
repetitions. Targets: tk within 3% of direct SDPA; >= 3.5x faster than naive at L = 1024.
A padding-mask row measures the fully-masked-row handling against SDPA with the same mask.

    python benchmarks/attention.py --quick      # smoke run (seconds)
    python benchmarks/attention.py              # full run (the lead runs it on an idle machine)

Prints a table; the last line is one JSON object with the headline ratios (at the largest L).

Generation: greedy decoding of 256 new tokens (batch 4) with ``tk.core.nn.generation.generate``,
KV-cached against recomputing the prefix every step. ``benchmarks/generation.py`` has the
full comparison (a simple-cache reference in the same run, beam search, per-step costs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tk.core.nn.attention import scaled_dot_product_attention
from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.nn.transformer import DecoderOnlyLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def naive_attention(q, k, v, mask=None, is_causal=False):
    """Materialised matmul -> masked_fill(-inf) -> softmax -> matmul (the baseline)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, T, T)
    if is_causal:
        T = q.shape[-2]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


def _attention_fns(mask: torch.Tensor | None) -> dict[str, Callable]:
    """The three implementations on tk's mask convention (mask None means causal)."""
    if mask is None:
        return {
            "tk": lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True)[0],
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "naive": lambda q, k, v: naive_attention(q, k, v, is_causal=True),
        }
    allowed = ~mask
    return {
        "tk": lambda q, k, v: scaled_dot_product_attention(q, k, v, mask)[0],
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
        "naive": lambda q, k, v: naive_attention(q, k, v, mask),
    }


def time_fwd_bwd(fns: dict[str, Callable], shape, dtype, device, reps: int, warmup: int) -> dict[str, float]:
    """Median seconds of forward + backward per implementation, interleaved."""
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=dtype, device=device)

    def run(fn):
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)

    for fn in fns.values():
        for _ in range(warmup):
            run(fn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for _ in range(reps):
        random.shuffle(order)  # no implementation always runs first (cache/thermal effects)
        for name in order:
            _sync(device)
            t0 = time.perf_counter()
            run(fns[name])
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def generation_benchmark(args, device: torch.device) -> dict[str, float]:
    """Cached vs uncached greedy ``generate``; returns median seconds and the speedup."""
    torch.manual_seed(0)
    dim, depth, steps = (64, 2, 16) if args.quick else (256, 4, 256)
    gpt = TransformerConfig(dim=dim, depth=depth, num_heads=4, dropout=0.0, activation="gelu", norm_first=True,
                            pos_encoding="learned", max_len=1024)
    model = DecoderOnlyLM(gpt, 1000).to(device).eval()
    prompt = torch.randint(0, 1000, (args.batch, 16), device=device)
    times = {"cached": [], "uncached": []}
    for _ in range(args.gen_reps):
        for name in random.sample(list(times), 2):
            _sync(device)
            t0 = time.perf_counter()
            cfg = GenerationConfig(strategy="greedy", max_len=steps, use_cache=name == "cached")
            out = generate(model, prompt, cfg).tokens
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    assert out.shape[1] == steps
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**med, "steps": steps, "speedup": med["uncached"] / med["cached"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--gen-reps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU); default: torch's")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    args.batch = args.batch or (1 if args.quick else 4)  # attention and generation batch
    args.reps = args.reps or (3 if args.quick else 20)
    args.gen_reps = args.gen_reps or (2 if args.quick else 5)
    heads = 2 if args.quick else args.heads
    torch.manual_seed(0)
    random.seed(0)

    print(f"device={device} dtype={dtype} B={args.batch} H={heads} Dh={args.head_dim} reps={args.reps} "
          f"threads={torch.get_num_threads()}")
    print(f"{'case':<10}{'L':>6}{'tk ms':>10}{'sdpa ms':>10}{'naive ms':>10}{'tk/sdpa':>10}{'naive/tk':>10}")
    headline = {}
    for case in ("causal", "padding"):
        for L in (64, 256, 1024):
            mask = None
            if case == "padding":  # last quarter of every sequence padded; key padding mask
                mask = torch.zeros(args.batch, 1, 1, L, dtype=torch.bool, device=device)
                mask[..., 3 * L // 4 :] = True
            med = time_fwd_bwd(_attention_fns(mask), (args.batch, heads, L, args.head_dim), dtype, device, args.reps, 2)
            ratio, speedup = med["tk"] / med["sdpa"], med["naive"] / med["tk"]
            print(f"{case:<10}{L:>6}{med['tk'] * 1e3:>10.3f}{med['sdpa'] * 1e3:>10.3f}{med['naive'] * 1e3:>10.3f}"
                  f"{ratio:>10.3f}{speedup:>10.2f}")
            if case == "causal":
                headline = {"L": L, "ratio_vs_sdpa": round(ratio, 4), "speedup_vs_naive": round(speedup, 3)}
            else:
                headline[f"padding_ratio_vs_sdpa_L{L}"] = round(ratio, 4)
    gen = generation_benchmark(args, device)
    print(f"generation ({gen['steps']} steps): cached {gen['cached'] * 1e3:.1f} ms, "
          f"uncached {gen['uncached'] * 1e3:.1f} ms, speedup {gen['speedup']:.2f}x")
    print(json.dumps({"benchmark": "attention", "device": device.type, "dtype": str(dtype).replace("torch.", ""),
                      **headline, "generation_cache_speedup": round(gen["speedup"], 3)}))


if __name__ == "__main__":
    main()
