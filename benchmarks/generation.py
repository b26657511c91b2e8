"""Benchmark: KV-cached vs uncached generation with tk.core.nn.generation.

Greedy decoding of 256 new tokens from a batch of prompts on a decoder-only LM (4 layers,
dim 256): the cached path feeds one token per step through ``decode_step``; the uncached
reference recomputes the whole prefix every step. Target: cached >= 10x faster (a simple
cache measured 17.7x on the lead's machine). Also timed: a bare ``decode_step`` + argmax
loop (the overhead of the generation API on top of the model), beam search (beam 4,
a quarter of the tokens) cached vs uncached, and the yardstick of the target: a minimal
nanoGPT-style reference model (``ReferenceLM`` below: tk's weight tensors, a ``torch.cat`` cache,
``F.scaled_dot_product_attention``) decoding the same prompts cached and uncached. All
variants run interleaved (random order per repetition); medians over repetitions. Every
run checks that all greedy variants produce the same tokens. Last, the cost of one cached
step with a short and with a full cache (only attention should grow with the cache;
per-step copying of the cache would show here).

The cached/uncached ratio depends on the machine and the batch: a cached step is a chain
of small (B x D) GEMMs, bound by weight reads and per-op overhead, while recomputation
runs large GEMMs that use every core. Compare tk's ratio with the reference's, measured
in the same run.

    python benchmarks/generation.py --quick     # smoke run (seconds)
    python benchmarks/generation.py             # full run (the lead runs it on an idle machine)
    python benchmarks/generation.py --threads 1 # steadier numbers on a shared CPU
    python benchmarks/generation.py --batches 1,4,16 --batch 4  # the default

``cached_time_vs_reference`` (target <= 1.05) is tk ``generate()``'s median time over the
reference's at each of ``--batches`` (keys ``..._b1``, ``..._b4``, ...; the key without a
suffix is the worst of them); both variants of every batch run in the same shuffled rounds.
With ``--processes N`` (default 3, quick 1) that ratio is measured in N fresh processes,
one after the other, and the headline is the median over them: where the weights and
caches land in memory is fixed per process and moves the ratio by up to +-0.06 on a shared
2-core VM (runs of one process disagree by that much while the rounds inside one agree).

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.nn.transformer import DecoderOnlyLM


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


class _RefAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)


class _RefMlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


class _RefLayer(nn.Module):
    """Pre-norm GPT block written out in one function (nanoGPT style); the KV cache is a
    dict whose keys/values grow by ``torch.cat`` every step."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn, self.mlp = _RefAttention(dim), _RefMlp(dim)

    def forward(self, x: Tensor, cache: dict[str, Tensor] | None) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.self_attn.qkv(self.norm1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        # T > 1 only for a prompt on an empty cache or for recomputation: plain causal.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        x = x + self.self_attn.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm2(x))))


class ReferenceLM(nn.Module):
    """The target's yardstick, "a simple cache": the same architecture as tk's default
    ``DecoderOnlyLM`` (learned positions, pre-norm, GELU, tied head) with parameter names
    that match, so it can use tk's weights (``share_parameters``) and both decode the same tokens."""

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok_embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.decoder = nn.ModuleDict({
            "layers": nn.ModuleList(_RefLayer(dim, heads) for _ in range(depth)), "norm": nn.LayerNorm(dim),
        })
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok_embed.weight

    def forward(self, idx: Tensor, caches: list[dict] | None = None, offset: int = 0) -> Tensor:
        x = self.tok_embed(idx) + self.pos.weight[offset : offset + idx.shape[1]]
        for i, layer in enumerate(self.decoder["layers"]):
            x = layer(x, None if caches is None else caches[i])
        return self.lm_head(self.decoder["norm"](x))


def share_parameters(reference: nn.Module, model: nn.Module) -> None:
    """Make every parameter of ``reference`` the tensor of the same name in ``model``: the same
    weights at the same addresses, so the two variants differ only in code, not in where
    their 13 MB of weights landed in memory (which alone moved the ratio by +-0.05 per process)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for prefix, module in reference.named_modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = params[f"{prefix}.{name}" if prefix else name]


@torch.no_grad()
def reference_greedy(model: ReferenceLM, prompt: Tensor, steps: int, use_cache: bool) -> Tensor:
    """Greedy decoding with the reference: cached (one token per step) or recomputing the
    whole sequence every step (logits for every position, the last one used)."""
    out = []
    if use_cache:
        caches: list[dict] = [{} for _ in model.decoder["layers"]]
        logits = model(prompt, caches)[:, -1]
        for i in range(steps):
            out.append(logits.argmax(-1, keepdim=True))
            if i + 1 < steps:
                logits = model(out[-1], caches, prompt.shape[1] + i)[:, -1]
        return torch.cat(out, dim=1)
    seq = prompt
    for _ in range(steps):
        out.append(model(seq)[:, -1].argmax(-1, keepdim=True))
        seq = torch.cat([seq, out[-1]], dim=1)
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


def ratios_in_processes(n: int) -> list[dict]:
    """Run this script with ``--ratios-only --processes 1`` (and the other arguments as given)
    in ``n`` fresh processes, one after the other; their JSON lines."""
    argv, skip = [], False
    for a in sys.argv[1:]:  # drop --processes N / --processes=N and --ratios-only
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes=") and a != "--ratios-only":
            argv.append(a)
    runs = []
    for _ in range(n):
        proc = subprocess.run([sys.executable, __file__, *argv, "--ratios-only", "--processes", "1"],
                              capture_output=True, text=True)
        if proc.returncode != 0 or not proc.stdout.strip():
            raise SystemExit(f"a measuring process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


def median_ratios(runs: list[dict]) -> dict:
    """Per batch, the median ratio over ``runs``; the worst batch's median; the count."""
    keys = [k for k in runs[0] if k.startswith("cached_time_vs_reference_b")]
    out = {k: round(statistics.median(run[k] for run in runs), 3) for k in keys}
    return {"cached_time_vs_reference": max(out.values()), **out, "processes": len(runs)}


def print_process_ratios(runs: list[dict]) -> None:
    """The ratios of every process, their medians, and the JSON line of ``--ratios-only``."""
    keys = [k for k in runs[0] if k.startswith("cached_time_vs_reference_b")]
    for i, run in enumerate(runs):
        print(f"process {i + 1}: " + ", ".join(f"B={k.rsplit('_b', 1)[1]}: {run[k]:.3f}" for k in keys))
    ratios = median_ratios(runs)
    print(f"median over {len(runs)} processes (target <= 1.05): "
          + ", ".join(f"B={k.rsplit('_b', 1)[1]}: {ratios[k]:.3f}" for k in keys))
    first = runs[0]
    print(json.dumps({"benchmark": "generation", "device": first["device"], "tokens": first["tokens"],
                      "batches": first["batches"], "threads": first["threads"], "reps": first["reps"], **ratios,
                      "tokens_equal": all(run["tokens_equal"] for run in runs)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, few tokens and repetitions (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per sequence (default 256; quick 32)")
    p.add_argument("--batches", default="1,4,16",
                   help="batch sizes at which generate() is timed against the reference (comma-separated)")
    p.add_argument("--batch", type=int, default=4,
                   help="the batch of the full comparison (uncached, beam, bare loop, step costs)")
    p.add_argument("--ratios-only", action="store_true",
                   help="time only generate() and the reference at each batch (the 1.05 target; minutes less)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7; quick 2)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--processes", type=int, default=None,
                   help="fresh processes measuring the generate()/reference ratios (default 3; quick 1); "
                        "the headline ratio is their median")
    args = p.parse_args()
    processes = args.processes or (1 if args.quick else 3)
    per_process = ratios_in_processes(processes) if processes > 1 else None
    if per_process is not None and args.ratios_only:  # nothing else to time here
        print_process_ratios(per_process)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokens = args.tokens or (32 if args.quick else 256)
    reps = args.reps or (2 if args.quick else 7)
    batches = sorted({int(b) for b in args.batches.split(",")} | {args.batch})
    dim, depth, heads = (64, 2, 4) if args.quick else (256, 4, 4)
    torch.manual_seed(0)
    random.seed(0)
    gpt = TransformerConfig(dim=dim, depth=depth, num_heads=heads, dropout=0.0, activation="gelu", norm_first=True,
                            pos_encoding="learned", max_len=1024)
    model = DecoderOnlyLM(gpt, 1000).to(device).eval()
    reference = ReferenceLM(1000, dim, depth, heads, max_len=1024).to(device).eval()
    share_parameters(reference, model)
    prompts = {b: torch.randint(3, 1000, (b, args.prompt_len), device=device) for b in batches}
    prompt = prompts[args.batch]

    def run(strategy: str, use_cache: bool, n: int, x: Tensor) -> Callable[[], torch.Tensor]:
        cfg = GenerationConfig(strategy=strategy, max_len=n, beam_size=4, use_cache=use_cache)
        return lambda: generate(model, x, cfg).tokens

    beam_tokens = max(tokens // 4, 1)
    full = {
        "greedy uncached": run("greedy", False, tokens, prompt),
        "bare decode_step loop": lambda: bare_loop(model, prompt, tokens),
        "beam4 cached": run("beam", True, beam_tokens, prompt),
        "beam4 uncached": run("beam", False, beam_tokens, prompt),
        "reference uncached": lambda: reference_greedy(reference, prompt, tokens, False),
    }
    fns = {} if args.ratios_only else full
    for b in batches:  # every variant of every batch in one shuffled round per repetition
        fns[f"B={b} greedy cached"] = run("greedy", True, tokens, prompts[b])
        fns[f"B={b} reference cached"] = partial(reference_greedy, reference, prompts[b], tokens, True)
    med, outs = time_interleaved(fns, reps, device)
    main_b = f"B={args.batch}"
    by_batch = {b: med[f"B={b} greedy cached"] / med[f"B={b} reference cached"] for b in batches}
    same_ref = all(torch.equal(outs[f"B={b} greedy cached"], outs[f"B={b} reference cached"]) for b in batches)
    print(f"device={device} threads={torch.get_num_threads()} batches={batches} prompt={args.prompt_len} "
          f"D={dim} depth={depth} H={heads} reps={reps}")
    print(f"{'variant':<26}{'tokens':>8}{'median ms':>12}{'ms/token':>10}")
    for name, t in med.items():
        n = beam_tokens if name.startswith("beam") else tokens
        print(f"{name:<26}{n:>8}{t * 1e3:>12.1f}{t * 1e3 / n:>10.3f}")
    print("tk generate() / reference cached time (target <= 1.05): "
          + ", ".join(f"B={b}: {r:.3f}" for b, r in by_batch.items()) + f"; tokens equal: {same_ref}")
    ratios = {"cached_time_vs_reference": round(max(by_batch.values()), 3),  # the worst batch
              **{f"cached_time_vs_reference_b{b}": round(r, 3) for b, r in by_batch.items()}}
    if per_process is not None:  # the headline: the median over fresh processes
        print(f"(this process: {ratios})")
        ratios = median_ratios(per_process)
        same_ref = same_ref and all(run["tokens_equal"] for run in per_process)
    if args.ratios_only:
        print(json.dumps({"benchmark": "generation", "device": device.type, "tokens": tokens, "batches": batches,
                          "threads": torch.get_num_threads(), "reps": reps, **ratios, "tokens_equal": same_ref}))
        return
    same = torch.equal(outs[f"{main_b} greedy cached"], outs["greedy uncached"])
    same_beam = torch.equal(outs["beam4 cached"], outs["beam4 uncached"])
    same_bare = torch.equal(outs[f"{main_b} greedy cached"], outs["bare decode_step loop"])
    same_ref = same_ref and torch.equal(outs[f"{main_b} greedy cached"], outs["reference uncached"])
    short, long = args.prompt_len, args.prompt_len + tokens
    steps = step_costs(model, prompt, (short, long), 10 if args.quick else 40, device)

    speedup = med["greedy uncached"] / med[f"{main_b} greedy cached"]
    beam_speedup = med["beam4 uncached"] / med["beam4 cached"]
    overhead = med[f"{main_b} greedy cached"] / med["bare decode_step loop"]
    print(f"greedy: cached {speedup:.2f}x faster than recomputation (target >= 10x); tokens equal: {same}")
    ref_speedup = med["reference uncached"] / med[f"{main_b} reference cached"]
    print(f"reference (simple cache): cached {ref_speedup:.2f}x faster than its recomputation; "
          f"tokens equal to tk's: {same_ref}")
    print(f"tk uncached / reference uncached: {med['greedy uncached'] / med['reference uncached']:.3f}")
    print(f"beam4: cached {beam_speedup:.2f}x faster; tokens equal: {same_beam}")
    print(f"generate() / bare loop: {overhead:.3f} (tokens equal: {same_bare})")
    print(f"cached decode_step: {steps[short] * 1e3:.3f} ms with {short} cached positions, "
          f"{steps[long] * 1e3:.3f} ms with {long}")
    print(json.dumps({
        "benchmark": "generation", "device": device.type, "tokens": tokens, "batch": args.batch,
        "threads": torch.get_num_threads(), "reps": reps,
        "speedup_cached": round(speedup, 3), "reference_speedup_cached": round(ref_speedup, 3),
        **ratios,
        "beam4_speedup_cached": round(beam_speedup, 3),
        "generate_overhead_vs_bare_loop": round(overhead, 3), "step_ms_short_cache": round(steps[short] * 1e3, 4),
        "step_ms_long_cache": round(steps[long] * 1e3, 4),
        "tokens_equal": same and same_beam and same_ref and same_bare,
    }))


if __name__ == "__main__":
    main()
