"""Benchmark: the training engine's steps/s against a bare hand-written PyTorch loop.

Same model (a small pre-norm Transformer LM), same DataLoader, same optimiser (AdamW
over tk's parameter groups) and the same constant LambdaLR; the engine runs
``Trainer.fit()`` (accumulation bookkeeping, per-tensor gradient norms read with the
loss in one host sync per update, non-finite check, logging every 10 updates), the bare loop
``loss / n -> backward -> step -> zero_grad -> scheduler.step`` with ``.item()`` every
10 updates. Engine and bare runs alternate in random order per repetition; the ratio
is of the median total times (everything counted); two noise-robust second figures for
shared machines: the ratio of the median single-update intervals (optimizer-step
timestamps) and of the process CPU time.
Rows: no clipping, and clipping at 1.0 (bare: ``torch.nn.utils.clip_grad_norm_``).
Target: engine >= 0.98x the bare loop.

Also measured on the model's real gradients, per update: the cost of the global
gradient norm (``torch._foreach_norm``), of one host sync (``.tolist()``), of the
engine's norms-with-the-loss sync (``tk.core.training.update``) and of its one in-place
scale/clip multiply (done only when the factor is not 1), as a share of the bare step time.

    python benchmarks/engine_overhead.py --quick   # smoke run (about a minute on 2 CPU cores)
    python benchmarks/engine_overhead.py           # full run (on an idle machine)

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tk.core.data.loader import LoaderSpec
from tk.core.engine.train import Trainer
from tk.core.optim import build_optimizer
from tk.core.recipe import load_config
from tk.core.schedule import build_scheduler
from tk.core.task import StepOutput, Task


@dataclass
class BenchData:
    num_train: int = 4096  # sequences
    seq_len: int = 32  # tokens per sequence
    vocab_size: int = 256  # token ids


@dataclass
class BenchModel:
    dim: int = 64  # width
    depth: int = 2  # layers
    num_heads: int = 4  # attention heads


class TinyLM(nn.Module):
    """Embedding -> pre-norm Transformer encoder layers (causal) -> LM head."""

    def __init__(self, vocab: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True,
                                                               norm_first=True) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, D)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)  # (B, T, V)


class BenchTask(Task):
    """Next-token prediction on random tokens (benchmark task)."""

    name = "bench"
    DataConfig = BenchData
    ModelConfig = BenchModel

    def build_dataset(self, split):
        d = self.data
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = d.num_train if split == "train" else 1
        return TensorDataset(torch.randint(0, d.vocab_size, (n, d.seq_len + 1), generator=g))

    def collate(self, samples):
        return {"tokens": torch.stack([s[0] for s in samples])}

    def build_model(self):
        d, m = self.data, self.model_cfg
        return TinyLM(d.vocab_size, m.dim, m.depth, m.num_heads)

    def loss(self, model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        return StepOutput(loss=loss, num_items=tokens[:, 1:].numel())


def make_config(steps: int, batch_size: int, clip: float | None, folder: Path):
    recipe = folder / "bench.yaml"
    recipe.write_text(f"task: bench\noptim: {{name: adamw, lr: 1.0e-3}}\n"
                      f"train: {{max_steps: {steps}, batch_size: {batch_size}, progress: false, log_every: 10,"
                      f" eval_batch_size: 1, clip_grad_norm: {'null' if clip is None else clip}}}\n")
    cfg, _ = load_config(recipe, task_loader=lambda _name: BenchTask)
    return cfg


def _stamp(optimizer: torch.optim.Optimizer) -> list[float]:
    """Times at which each optimizer step ends (for per-update intervals)."""
    stamps: list[float] = []
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return stamps


def time_engine(cfg) -> tuple[float, float, list[float]]:
    """Seconds of ``Trainer.fit()`` for ``cfg.train.max_steps`` updates (the final
    evaluation is one sequence: a negligible share), CPU seconds of this process, and
    the per-update intervals."""
    trainer = Trainer(cfg, BenchTask, run_dir=None)
    stamps = _stamp(trainer.optimizer)
    with contextlib.redirect_stdout(io.StringIO()):
        tic, cpu = time.perf_counter(), time.process_time()
        trainer.fit()
        return time.perf_counter() - tic, time.process_time() - cpu, [b - a for a, b in zip(stamps, stamps[1:])]


def time_bare(cfg) -> tuple[float, float, list[float]]:
    """Seconds of a hand-written loop over the same model, loader and optimiser, CPU
    seconds, and the per-update intervals."""
    torch.manual_seed(cfg.train.seed)
    task = BenchTask(cfg)
    loader = task.build_loader("train", LoaderSpec(batch_size=cfg.train.batch_size, shuffle=True, drop_last=True))
    model = task.build_model()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.train.max_steps)
    clip = cfg.train.clip_grad_norm
    stamps = _stamp(optimizer)
    model.train()
    tic, cpu = time.perf_counter(), time.process_time()
    for step, batch in enumerate(loader, start=1):
        out = task.loss(model, batch)
        (out.loss / out.num_items).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % 10 == 0:
            out.loss.item()
        if step == cfg.train.max_steps:
            break
    return time.perf_counter() - tic, time.process_time() - cpu, [b - a for a, b in zip(stamps, stamps[1:])]


def component_costs(cfg, reps: int) -> dict[str, float]:
    """Median milliseconds of the engine's per-update extras on real gradients."""
    task = BenchTask(cfg)
    model = task.build_model()
    batch = task.collate([task.build_dataset("train")[i] for i in range(cfg.train.batch_size)])
    task.loss(model, batch).loss.backward()
    grads = [p.grad for p in model.parameters()]
    backup = [g.clone() for g in grads]
    fns = {
        "grad_norm": lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
        "host_sync": lambda: torch.zeros(4).tolist(),
        "norms_and_sync": lambda: torch.stack([grads[0].sum(), *torch._foreach_norm(grads)]).tolist(),
        "clip_multiply": lambda: torch._foreach_mul_(grads, 0.5),
    }
    out = {}
    for name, fn in fns.items():
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            fn()
            times.append(time.perf_counter() - tic)
            torch._foreach_copy_(grads, backup)
        out[name] = 1000 * statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few steps and repetitions (checks that it runs)")
    p.add_argument("--steps", type=int, default=None, help="updates per timed run")
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    steps = args.steps or (10 if args.quick else 60)
    reps = args.reps or (3 if args.quick else 9)
    torch.manual_seed(0)
    rng = random.Random(0)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, clip in (("no clipping", None), ("clip 1.0", 1.0)):
            cfg = make_config(steps, args.batch_size, clip, Path(tmp))
            time_engine(cfg), time_bare(cfg)  # warm-up (allocator, kernels, imports)
            times: dict[str, list[float]] = {"engine": [], "bare": []}
            cpu: dict[str, list[float]] = {"engine": [], "bare": []}
            steps_dt: dict[str, list[float]] = {"engine": [], "bare": []}
            for _ in range(reps):
                order = ["engine", "bare"]
                rng.shuffle(order)
                for who in order:
                    total, cpu_s, intervals = (time_engine if who == "engine" else time_bare)(cfg)
                    times[who].append(total)
                    cpu[who].append(cpu_s)
                    steps_dt[who] += intervals
            med = {k: statistics.median(v) for k, v in times.items()}
            rows[label] = {"engine_steps_per_s": steps / med["engine"], "bare_steps_per_s": steps / med["bare"],
                           "ratio": med["bare"] / med["engine"], "bare_ms_per_step": 1000 * med["bare"] / steps,
                           "ratio_step": statistics.median(steps_dt["bare"]) / statistics.median(steps_dt["engine"]),
                           "ratio_cpu": statistics.median(cpu["bare"]) / statistics.median(cpu["engine"])}
        costs = component_costs(cfg, 20 if args.quick else 100)

    print(f"engine vs bare loop, {steps} updates x {reps} reps, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'variant':<14} {'engine steps/s':>15} {'bare steps/s':>13} {'ratio':>7} {'bare ms/step':>13} "
          f"{'ratio (median step)':>20} {'ratio (CPU time)':>17}")
    for label, r in rows.items():
        print(f"{label:<14} {r['engine_steps_per_s']:>15.2f} {r['bare_steps_per_s']:>13.2f} {r['ratio']:>7.3f} "
              f"{r['bare_ms_per_step']:>13.1f} {r['ratio_step']:>20.3f} {r['ratio_cpu']:>17.3f}")
    step_ms = rows["no clipping"]["bare_ms_per_step"]
    print(f"per-update extras (ms, share of a bare step of {step_ms:.1f} ms):")
    for name, ms in costs.items():
        print(f"  {name:<16} {ms:8.3f} ms  {100 * ms / step_ms:6.2f}%")
    print(json.dumps({"benchmark": "engine_overhead", "quick": args.quick, "steps": steps, "reps": reps,
                      "ratio_no_clip": round(rows["no clipping"]["ratio"], 4),
                      "ratio_clip": round(rows["clip 1.0"]["ratio"], 4), "target": 0.98,
                      "ratio_step_no_clip": round(rows["no clipping"]["ratio_step"], 4),
                      "ratio_cpu_no_clip": round(rows["no clipping"]["ratio_cpu"], 4),
                      "bare_ms_per_step": round(step_ms, 2),
                      **{f"{k}_ms": round(v, 4) for k, v in costs.items()}}))


if __name__ == "__main__":
    main()
