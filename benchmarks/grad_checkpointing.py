"""Benchmark: activation checkpointing (``train.grad_checkpointing``) on the decoder-only LM,
activation memory and step time with and without it.

The model is ``recipes/gpt2_small_owt.yaml``'s shape (12 blocks, 768 wide, 12 heads, learned
positions, tied embeddings) at a CPU-sized batch; ``--quick`` shrinks it to check that the
script runs. Memory is what autograd keeps for backward during one forward pass
(``tk.core.engine.summary.ActivationMeter``, the meter ``tk run`` prints), plus, with
checkpointing, the activations of the one block that backward recomputes at a time (its
transient peak): ``saved + one block``. Time is one update (forward, backward, AdamW step),
checkpointing on and off interleaved, median over repetitions.
Target (issue "scale out"): <= 0.5x memory at <= 1.4x time.

    python benchmarks/grad_checkpointing.py --quick   # seconds
    python benchmarks/grad_checkpointing.py           # the full shape (minutes on 2 CPU cores)

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from tk.core.engine.summary import ActivationMeter
from tk.core.nn.config import TransformerConfig
from tk.core.nn.transformer import DecoderOnlyLM

VOCAB = 50304  # GPT-2's vocabulary, padded as nanoGPT pads it


def build(dim: int, depth: int, heads: int, seq: int, vocab: int) -> DecoderOnlyLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(dim=dim, depth=depth, num_heads=heads, mlp_ratio=4.0, dropout=0.0, bias=True,
                            pos_encoding="learned", max_len=seq, tie_embeddings=True)
    return DecoderOnlyLM(cfg, vocab)


def saved_bytes(model: DecoderOnlyLM, tokens: torch.Tensor, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward in one training forward pass."""
    model.train()
    model.set_grad_checkpointing(checkpointing)
    with ActivationMeter(model) as meter:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    del loss
    return meter.bytes


def step_time(model: DecoderOnlyLM, opt: torch.optim.Optimizer, tokens: torch.Tensor, checkpointing: bool) -> float:
    """Seconds of one update."""
    model.set_grad_checkpointing(checkpointing)
    start = time.perf_counter()
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and few repetitions (checks that it runs)")
    p.add_argument("--reps", type=int, default=None, help="timed updates per setting (interleaved)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    args = p.parse_args()
    dim, depth, heads, vocab = (128, 4, 4, 512) if args.quick else (768, 12, 12, VOCAB)
    batch, seq = args.batch or 4, args.seq or (64 if args.quick else 256)
    reps = args.reps or (3 if args.quick else 5)

    model = build(dim, depth, heads, seq, vocab)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    full = saved_bytes(model, tokens, checkpointing=False)
    kept = saved_bytes(model, tokens, checkpointing=True)
    one_block = full - saved_bytes(build(dim, depth - 1, heads, seq, vocab), tokens, checkpointing=False)
    peak_ckpt = kept + one_block

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for flag in (False, True):  # warm-up: allocator, AdamW state
        step_time(model, opt, tokens, flag)
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps):
        for flag in ((False, True) if rep % 2 == 0 else (True, False)):  # alternate who goes first
            times[flag].append(step_time(model, opt, tokens, flag))
    off, on = statistics.median(times[False]), statistics.median(times[True])

    mib = 2**20
    print(f"decoder-only LM dim {dim} depth {depth} heads {heads}, batch {batch} x {seq} tokens, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'setting':22s} {'activations MiB':>16s} {'step s (median)':>16s}")
    print(f"{'no checkpointing':22s} {full / mib:16.1f} {off:16.3f}")
    print(f"{'checkpointing':22s} {peak_ckpt / mib:16.1f} {on:16.3f}   "
          f"(saved {kept / mib:.1f} + one block {one_block / mib:.1f})")
    print(f"memory {peak_ckpt / full:.3f}x (target <= 0.5x), time {on / off:.3f}x (target <= 1.4x); "
          f"per-rep times off {[round(t, 3) for t in times[False]]} on {[round(t, 3) for t in times[True]]}")
    print(json.dumps({"benchmark": "grad_checkpointing", "quick": args.quick, "dim": dim, "depth": depth,
                      "batch": batch, "seq": seq, "reps": reps, "activation_mib_off": round(full / mib, 1),
                      "activation_mib_on": round(peak_ckpt / mib, 1), "memory_ratio": round(peak_ckpt / full, 3),
                      "step_s_off": round(off, 4), "step_s_on": round(on, 4), "time_ratio": round(on / off, 3)}))


if __name__ == "__main__":
    main()
