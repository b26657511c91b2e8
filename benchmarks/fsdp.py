"""Benchmark: FSDP2 (``train.strategy: fsdp``) against DDP step time, and fused against
unfused AdamW (``optim.fused``).

1. Two gloo processes on CPU train the same small decoder-only LM at the same global batch
   (each process gets half): DDP (``DistributedDataParallel``) vs FSDP2 (tk's
   ``wrap_fsdp``: ``fully_shard`` per block and at the root, neighbouring blocks prefetched). One step is the engine's:
   forward, summed cross-entropy, backward, the global gradient norm (one all-reduced
   number under FSDP), clip at 1.0, AdamW step, zero. Strategies run in interleaved rounds
   (DDP, FSDP, FSDP with ``train.fsdp_reshard=false``: blocks stay gathered from forward to
   backward, one all-gather per block instead of two); median over rounds of each round's
   median step time after warm-up. Target: FSDP <= 1.3x DDP. On CPU/gloo FSDP pays an all-gather per block in forward
   and backward and a reduce-scatter, against DDP's one bucketed all-reduce: the ratio
   says what sharding costs where memory is not the limit.
2. One process: ``torch.optim.AdamW`` step time with ``fused=True`` vs ``foreach=True``
   vs the single-tensor loop (``foreach=False``) over the same model's parameters.

    python benchmarks/fsdp.py --quick   # smoke run (a minute or two on 2 shared CPU cores)
    python benchmarks/fsdp.py           # full run (on an idle machine)

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from tk.core.nn.config import TransformerConfig
from tk.core.nn.transformer import DecoderOnlyLM
from tk.core.training.parallel import wrap_fsdp
from tk.core.training.update import grad_norms, normalise_and_clip_

VOCAB, SEQ = 256, 64


def build(dim: int, depth: int) -> DecoderOnlyLM:
    torch.manual_seed(0)
    return DecoderOnlyLM(TransformerConfig(dim=dim, depth=depth, num_heads=4, dropout=0.0, max_len=SEQ), VOCAB)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int, steps: int, seed: int) -> list[float]:
    """Times of ``steps`` engine-like updates (seconds each)."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.stack(grad_norms(grads)).square().sum().sqrt())
        normalise_and_clip_(grads, 1.0 / tokens[:, 1:].numel(), norm / tokens[:, 1:].numel(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, port: int, strategy: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = build(args.dim, args.depth)
        if strategy == "ddp":
            model = DistributedDataParallel(model)
        else:  # fsdp: blocks resharded after forward; fsdp_keep: gathered until backward (train.fsdp_reshard=false)
            model = wrap_fsdp(model, torch.device("cpu"), 2, reshard=strategy == "fsdp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = train_steps(model, opt, args.batch // 2, args.warmup + args.steps, seed=rank)[args.warmup:]
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        torch.save({"times": times, "local_params": local}, f"{out}/{strategy}{rank}.pt")
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STRATEGIES = ("ddp", "fsdp", "fsdp_keep")


def data_parallel(args: argparse.Namespace) -> dict[str, dict]:
    """Per strategy: the median over ``args.reps`` rounds (strategies interleaved, the order
    rotating each round) of each round's median step time of the slower rank."""
    rounds: dict[str, list[float]] = {k: [] for k in STRATEGIES}
    local: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as out:
        for rep in range(args.reps):
            order = STRATEGIES[rep % len(STRATEGIES):] + STRATEGIES[:rep % len(STRATEGIES)]
            for strategy in order:
                mp.spawn(_worker, args=(_port(), strategy, args, out), nprocs=2, join=True)
                ranks = [torch.load(Path(out) / f"{strategy}{r}.pt") for r in (0, 1)]
                step = [max(a, b) for a, b in zip(ranks[0]["times"], ranks[1]["times"])]  # the slower rank
                rounds[strategy].append(1e3 * statistics.median(step))
                local[strategy] = ranks[0]["local_params"]
    return {k: {"step_ms": statistics.median(v), "rounds_ms": v, "local_params": local[k]} for k, v in rounds.items()}


def optimiser_kernels(args: argparse.Namespace) -> dict[str, float]:
    model = build(args.dim, args.depth)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    rows = {}
    for name, kernel in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("loop", {"foreach": False})):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kernel)
        times = []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            opt.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        rows[name] = 1e3 * statistics.median(times)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and few steps (checks that it runs)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round")
    p.add_argument("--reps", type=int, default=None, help="interleaved rounds per strategy")
    args = p.parse_args()
    args.dim, args.depth = (64, 2) if args.quick else (256, 6)
    args.batch = 8 if args.quick else 32  # global batch: each process gets half
    args.warmup = 2 if args.quick else 5
    args.steps = args.steps or (8 if args.quick else 20)
    args.reps = args.reps or (1 if args.quick else 3)

    dp = data_parallel(args)
    ratio = dp["fsdp"]["step_ms"] / dp["ddp"]["step_ms"]
    keep = dp["fsdp_keep"]["step_ms"] / dp["ddp"]["step_ms"]
    print(f"LM dim {args.dim} depth {args.depth}, global batch {args.batch} x {SEQ} tokens, 2 gloo processes, "
          f"{args.reps} interleaved rounds of {args.steps} timed steps, {platform.processor() or platform.machine()}")
    print(f"{'strategy':10s} {'step ms':>10s} {'params/process':>15s}  rounds")
    for name, row in dp.items():
        rounds = [round(v, 1) for v in row["rounds_ms"]]
        print(f"{name:10s} {row['step_ms']:10.1f} {row['local_params']:15,d}  {rounds}")
    print(f"fsdp / ddp step time: {ratio:.2f}x, with train.fsdp_reshard=false {keep:.2f}x (target <= 1.3x)")
    opt = optimiser_kernels(args)
    print(f"\n{'AdamW kernel':12s} {'step ms':>10s}")
    for name, ms in opt.items():
        print(f"{name:12s} {ms:10.3f}")
    print(json.dumps({"benchmark": "fsdp", "quick": args.quick, "steps": args.steps, "reps": args.reps,
                      "dim": args.dim,
                      "depth": args.depth, "global_batch": args.batch, "ddp_step_ms": round(dp["ddp"]["step_ms"], 2),
                      "fsdp_step_ms": round(dp["fsdp"]["step_ms"], 2), "fsdp_over_ddp": round(ratio, 3),
                      "fsdp_keep_over_ddp": round(keep, 3),
                      "fsdp_params_per_process": dp["fsdp"]["local_params"],
                      "ddp_params_per_process": dp["ddp"]["local_params"],
                      "adamw_ms": {k: round(v, 3) for k, v in opt.items()},
                      "fused_over_foreach": round(opt["fused"] / opt["foreach"], 3)}))


if __name__ == "__main__":
    main()
