"""Benchmark: KV-cached vs uncached generation with tk.core.generation.

Greedy decoding of 256 new tokens from a batch of prompts on a decoder-only LM (4 layers,
dim 256): the cached path feeds one token per step through ``decode_step``; the uncached
reference recomputes the whole prefix every step. Target: cached >= 10x faster (a simple
cache measured 17.7x on the lead's machine). Also timed: a bare ``decode_step`` + argmax
loop (the overhead of the generation API on top of the model), and beam search (beam 4,
a quarter of the tokens) cached vs uncached. All variants run interleaved (random order
per repetition); medians over repetitions. Every run checks cached == uncached tokens.
Last, the cost of one cached step with a short and with a full cache (only attention
should grow with the cache; per-step copying of the cache would show here).

    python benchmarks/generation.py --quick     # smoke run (seconds)
    python benchmarks/generation.py             # full run (the lead runs it on an idle machine)
    python benchmarks/generation.py --threads 1 # steadier numbers on a shared CPU

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Callable

import torch

from tk.core.generation import GenerationConfig, generate
from tk.core.transformer import DecoderOnlyLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bare_loop(model: DecoderOnlyLM, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The minimal cached greedy loop (no EOS handling): the floor for ``generate``."""
    cache = model.init_cache(prompt.shape[0], prompt.shape[1] + steps)
    logits = model.decode_step(prompt, cache)[:, -1]
    out = []
    for i in range(steps):
        out.append(logits.argmax(-1, keepdim=True))
        if i + 1 < steps:
            logits = model.decode_step(out[-1], cache)[:, -1]
    return torch.cat(out, dim=1)


def time_interleaved(fns: dict[str, Callable[[], torch.Tensor]], reps: int, device: torch.device):
    """Median seconds per variant (one warm-up call each, then ``reps`` shuffled rounds) and
    each variant's last output."""
    outs = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for _ in range(reps):
        random.shuffle(order)  # no variant always runs first
        for name in order:
            _sync(device)
            t0 = time.perf_counter()
            outs[name] = fns[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}, outs


def step_costs(
    model: DecoderOnlyLM, prompt: torch.Tensor, lengths: tuple[int, ...], reps: int, device: torch.device
) -> dict[int, float]:
    """Median seconds of one cached ``decode_step`` with the cache already holding each of
    ``lengths`` positions, interleaved. Only attention should grow with the length; a cache
    that grew by copying (``torch.cat`` per step) would show up here."""
    caches, times = {}, {n: [] for n in lengths}
    tok = prompt[:, -1:]
    with torch.no_grad():
        for n in lengths:
            caches[n] = model.init_cache(prompt.shape[0], n + reps + 1)
            model.decode_step(prompt.repeat(1, -(-n // prompt.shape[1]))[:, :n], caches[n])
        for _ in range(reps):
            for n in random.sample(lengths, len(lengths)):
                _sync(device)
                t0 = time.perf_counter()
                model.decode_step(tok, caches[n])
                _sync(device)
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, few tokens and repetitions (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per sequence (default 256; quick 32)")
    p.add_argument("--batch", type=int, default=4, help="prompts per batch")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; quick 2)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokens = args.tokens or (32 if args.quick else 256)
    reps = args.reps or (2 if args.quick else 5)
    dim, depth, heads = (64, 2, 4) if args.quick else (256, 4, 4)
    torch.manual_seed(0)
    random.seed(0)
    model = DecoderOnlyLM(1000, dim, depth, heads, max_len=1024).to(device).eval()
    prompt = torch.randint(3, 1000, (args.batch, args.prompt_len), device=device)

    def run(strategy: str, use_cache: bool, n: int) -> Callable[[], torch.Tensor]:
        cfg = GenerationConfig(strategy=strategy, max_len=n, beam_size=4, use_cache=use_cache)
        return lambda: generate(model, prompt, cfg).tokens

    beam_tokens = max(tokens // 4, 1)
    fns = {
        "greedy cached": run("greedy", True, tokens),
        "greedy uncached": run("greedy", False, tokens),
        "bare decode_step loop": lambda: bare_loop(model, prompt, tokens),
        "beam4 cached": run("beam", True, beam_tokens),
        "beam4 uncached": run("beam", False, beam_tokens),
    }
    med, outs = time_interleaved(fns, reps, device)
    same = torch.equal(outs["greedy cached"], outs["greedy uncached"])
    same_beam = torch.equal(outs["beam4 cached"], outs["beam4 uncached"])
    same_bare = torch.equal(outs["greedy cached"], outs["bare decode_step loop"])
    short, long = args.prompt_len, args.prompt_len + tokens
    steps = step_costs(model, prompt, (short, long), 10 if args.quick else 40, device)

    print(f"device={device} threads={torch.get_num_threads()} B={args.batch} prompt={args.prompt_len} "
          f"D={dim} depth={depth} H={heads} reps={reps}")
    print(f"{'variant':<24}{'tokens':>8}{'median ms':>12}{'ms/token':>10}")
    for name, t in med.items():
        n = beam_tokens if name.startswith("beam") else tokens
        print(f"{name:<24}{n:>8}{t * 1e3:>12.1f}{t * 1e3 / n:>10.3f}")
    speedup = med["greedy uncached"] / med["greedy cached"]
    beam_speedup = med["beam4 uncached"] / med["beam4 cached"]
    overhead = med["greedy cached"] / med["bare decode_step loop"]
    print(f"greedy: cached {speedup:.2f}x faster than recomputation (target >= 10x); tokens equal: {same}")
    print(f"beam4: cached {beam_speedup:.2f}x faster; tokens equal: {same_beam}")
    print(f"generate() / bare loop: {overhead:.3f} (tokens equal: {same_bare})")
    print(f"cached decode_step: {steps[short] * 1e3:.3f} ms with {short} cached positions, "
          f"{steps[long] * 1e3:.3f} ms with {long}")
    print(json.dumps({
        "benchmark": "generation", "device": device.type, "tokens": tokens, "batch": args.batch,
        "speedup_cached": round(speedup, 3), "beam4_speedup_cached": round(beam_speedup, 3),
        "generate_overhead_vs_bare_loop": round(overhead, 3), "step_ms_short_cache": round(steps[short] * 1e3, 4),
        "step_ms_long_cache": round(steps[long] * 1e3, 4), "tokens_equal": same and same_beam,
    }))


if __name__ == "__main__":
    main()
