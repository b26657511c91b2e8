"""Benchmark: ms/iteration of the Shakespeare recipe through tk's engine vs a bare PyTorch loop.

The recipe ``lm_shakespeare_char`` (character level, block 64, batch 12, 4 layers x 128,
AdamW (0.9, 0.99), weight decay 0.1, clip 1.0, warmup + cosine) on tiny Shakespeare. tk:
``Trainer.fit()`` with the task's random-block loader. Bare loop, nanoGPT style: the same
token array, ``get_batch`` stacking ``data[i : i + 65]`` slices at the same offsets as tk's
sampler (so the same batches), the same initial weights (copied from the engine's model),
``F.cross_entropy`` mean, backward, ``clip_grad_norm_``, AdamW over the same parameter
groups, the same LR schedule, ``loss.item()`` every ``log_every`` iterations. Both variants
alternate in random order per repetition of N iterations; the time of a run is from its
first to its last optimizer step (set-up and the final evaluation are not counted);
medians over repetitions. Both variants must reach the same loss (same batches, weights
and updates). Target: tk speed >= 1.0x the bare loop's.

    python benchmarks/lm.py --quick                   # smoke run: a small generated text
    python benchmarks/lm.py --data path/to/input.txt  # default: ../shared/data/tinyshakespeare/input.txt

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tk.core.data.loader import LoaderSpec
from tk.core.engine.train import Trainer
from tk.core.optim import build_optimizer
from tk.core.recipe import load_config
from tk.core.schedule import build_scheduler
from tk.plugins.language_model.corpus import synthetic_text

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def make_config(data: Path, iters: int):
    overrides = [f"data.path={data}", f"train.max_steps={iters}", f"train.eval_every={iters}", "data.eval_blocks=1",
                 "train.eval_batch_size=1", "data.num_samples=0", "train.progress=false", "train.num_workers=0"]
    return load_config("lm_shakespeare_char", overrides)


def _stamp(optimizer: torch.optim.Optimizer) -> list[float]:
    stamps: list[float] = []
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return stamps


def run_engine(cfg, task_cls) -> tuple[float, dict, dict]:
    """Seconds from the first to the last optimizer step of ``Trainer.fit()``, and the
    initial (for the bare loop) and final weights."""
    trainer = Trainer(cfg, task_cls, run_dir=None)
    init = copy.deepcopy(trainer.model.state_dict())
    stamps = _stamp(trainer.optimizer)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit()
    return stamps[-1] - stamps[0], init, trainer.model.state_dict()


def run_bare(cfg, task_cls, init: dict) -> tuple[float, dict]:
    """The nanoGPT-style loop: seconds from the first to the last optimizer step, final weights."""
    t = cfg.train
    task = task_cls(cfg)
    task.setup()
    data = task.splits["train"]  # the token array (np.uint16)
    block = task.data.block_size
    sampler = task.build_loader("train", LoaderSpec(batch_size=t.batch_size, shuffle=True, seed=t.seed)).batch_sampler
    model = task.build_model()
    model.load_state_dict(init)
    model.train()
    optimizer = build_optimizer(model, cfg.optim, groups=task.param_groups(model, cfg.optim))
    scheduler = build_scheduler(optimizer, cfg.schedule, t.max_steps)
    stamps = _stamp(optimizer)

    def get_batch(offsets):
        x = torch.stack([torch.from_numpy(data[i: i + block].astype(np.int64)) for i in offsets])
        y = torch.stack([torch.from_numpy(data[i + 1: i + 1 + block].astype(np.int64)) for i in offsets])
        return x, y

    for it, offsets in zip(range(1, t.max_steps + 1), sampler):
        x, y = get_batch(offsets)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if it % t.log_every == 0:
            loss.item()  # what a logging loop reads
    return stamps[-1] - stamps[0], model.state_dict()


def final_val_losses(cfg, task_cls, final: dict[str, dict]) -> dict[str, float]:
    """Mean loss of each variant's final weights on the first 8 val blocks. Same batches,
    weights and updates give the same loss (AdamW turns float noise in near-zero gradients
    into +-lr steps, so the weights agree to about lr, not bitwise)."""
    task = task_cls(cfg)
    task.setup()
    T = task.data.block_size
    x = torch.from_numpy(task.splits["val"][: 8 * (T + 1)].astype(np.int64)).view(8, T + 1)
    val = {}
    for k, state in final.items():
        model = task.build_model().eval()
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(x[:, :-1])
            val[k] = float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))
    return val


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small generated text, few iterations (smoke test)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="tiny Shakespeare's input.txt")
    p.add_argument("--iters", type=int, default=None, help="iterations per timed run (default 100; quick 6)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 5; quick 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    iters = args.iters or (6 if args.quick else 100)
    reps = args.reps or (1 if args.quick else 5)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:  # --quick writes its text here
        data = args.data
        if args.quick:
            data = Path(tmp) / "input.txt"
            data.write_text(synthetic_text(2000, 0))
        elif not data.is_file():
            raise SystemExit(f"--data: no file at {data}; download tiny Shakespeare's input.txt or pass --quick")
        cfg, task_cls = make_config(data, iters)
        cfg.train.log_every = min(cfg.train.log_every, iters)
        _, init, _ = run_engine(cfg, task_cls)  # warm-up (allocator, kernels) and the initial weights
        run_bare(cfg, task_cls, init)
        times: dict[str, list[float]] = {"tk": [], "bare": []}
        final: dict[str, dict] = {}
        for _ in range(reps):
            for who in rng.sample(["tk", "bare"], 2):
                if who == "tk":
                    dt, init, final["tk"] = run_engine(cfg, task_cls)
                else:  # the initial weights of the latest engine run (the same every time: seeded)
                    dt, final["bare"] = run_bare(cfg, task_cls, init)
                times[who].append(dt)
        val = final_val_losses(cfg, task_cls, final)
    same = abs(val["tk"] - val["bare"]) <= 1e-3 * abs(val["bare"])
    ms = {k: 1000 * statistics.median(v) / (iters - 1) for k, v in times.items()}
    speed = ms["bare"] / ms["tk"]

    print(f"lm_shakespeare_char: {iters} iterations x {reps} reps, batch {cfg.train.batch_size}, block "
          f"{cfg.sections['data'].block_size}, {torch.get_num_threads()} threads, data {data if not args.quick else 'generated'}")
    print(f"{'variant':<10}{'median ms/iter':>16}{'runs (ms/iter)':>40}")
    for k, v in times.items():
        runs = ", ".join(f"{1000 * x / (iters - 1):.1f}" for x in v)
        print(f"{k:<10}{ms[k]:>16.2f}   {runs}")
    print(f"tk speed / bare loop speed: {speed:.3f} (target >= 1.0); val loss of the final weights: tk "
          f"{val['tk']:.5f}, bare {val['bare']:.5f} (same: {same})")
    print(json.dumps({"benchmark": "lm", "quick": args.quick, "iters": iters, "reps": reps,
                      "threads": torch.get_num_threads(), "tk_ms_per_iter": round(ms["tk"], 3),
                      "bare_ms_per_iter": round(ms["bare"], 3), "tk_speed_vs_bare": round(speed, 4),
                      "target": 1.0, "val_loss_tk": round(val["tk"], 5), "val_loss_bare": round(val["bare"], 5),
                      "same_updates": same}))


if __name__ == "__main__":
    main()
