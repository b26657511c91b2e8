"""Benchmark: LoRA (``model.lora``) against full fine-tuning, step time of the text classifier
of ``recipes/sst2_minilm.yaml`` (all-MiniLM-L6-v2's shape: 6 post-norm blocks, 384 wide,
12 heads, 30,522-token vocabulary, mean pooling) at that recipe's batch of 32.

One update is the engine's: forward, summed cross-entropy, backward, gradient clipping at 1.0,
AdamW step over the trainable parameters, zero. LoRA (rank 8, alpha 16, attention + MLP
projections; head trainable) and full fine-tuning are timed interleaved on two copies of the
same weights; median over repetitions. Target (issue "models move"): LoRA <= 0.7x the full
fine-tuning step time (its accuracy is measured by the recipe runs, see the recipe header).

    python benchmarks/lora.py --quick   # seconds
    python benchmarks/lora.py           # the MiniLM shape (a minute or two on 2 CPU cores)

Prints a table; the last line is one JSON object with the headline ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from tk.core.nn.config import TransformerConfig
from tk.core.nn.lora import apply_lora
from tk.core.nn.text_encoder import TextEncoder
from tk.plugins.text_classification.model import TextClassifier


def build(dim: int, depth: int, heads: int, vocab: int) -> TextClassifier:
    torch.manual_seed(0)
    cfg = TransformerConfig(dim=dim, depth=depth, num_heads=heads, mlp_ratio=4.0, dropout=0.1, norm_first=False,
                            pos_encoding="learned", max_len=512)
    return TextClassifier(TextEncoder(cfg, vocab), num_classes=2, pooling="mean", head_dropout=0.1)


def step_time(model: TextClassifier, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Seconds of one update."""
    start = time.perf_counter()
    loss = F.cross_entropy(model(ids), labels, reduction="sum")
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and few repetitions (checks that it runs)")
    p.add_argument("--reps", type=int, default=None, help="timed updates per setting (interleaved)")
    p.add_argument("--seq", type=int, default=48, help="tokens per sentence (SST-2 batches pad to ~30-60)")
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    dim, depth, heads, vocab = (64, 2, 4, 1000) if args.quick else (384, 6, 12, 30522)
    batch, reps = 32, args.reps or (3 if args.quick else 15)

    full = build(dim, depth, heads, vocab)
    lora = copy.deepcopy(full)
    apply_lora(lora, rank=args.rank, alpha=2.0 * args.rank, targets=("attention", "mlp"))
    models = {"full": full, "lora": lora}
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
            for name, m in models.items()}
    trainable = {name: sum(p.numel() for p in m.parameters() if p.requires_grad) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, args.seq), generator=gen)
    labels = torch.randint(0, 2, (batch,), generator=gen)
    for name, m in models.items():  # warm-up: allocator, AdamW state
        m.train()
        for _ in range(2):
            step_time(m, opts[name], ids, labels)
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for rep in range(reps):
        order = ["full", "lora"] if rep % 2 == 0 else ["lora", "full"]  # alternate who goes first
        for name in order:
            times[name].append(step_time(models[name], opts[name], ids, labels))
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["lora"] / med["full"]

    print(f"text classifier dim {dim} depth {depth} heads {heads} vocab {vocab}, batch {batch} x {args.seq} tokens, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'setting':26s} {'trainable params':>17s} {'step ms (median)':>17s}")
    print(f"{'full fine-tuning':26s} {trainable['full']:17,d} {1e3 * med['full']:17.1f}")
    print(f"{f'LoRA r={args.rank} attention+mlp':26s} {trainable['lora']:17,d} {1e3 * med['lora']:17.1f}")
    print(f"LoRA / full step time: {ratio:.3f}x (target <= 0.7x)")
    print(json.dumps({"benchmark": "lora", "quick": args.quick, "dim": dim, "depth": depth, "batch": batch,
                      "seq": args.seq, "rank": args.rank, "reps": reps, "trainable_full": trainable["full"],
                      "trainable_lora": trainable["lora"], "step_ms_full": round(1e3 * med["full"], 2),
                      "step_ms_lora": round(1e3 * med["lora"], 2), "time_ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
