"""Benchmark: the core ViT against timm's VisionTransformer of the same shape on CIFAR-sized input.

1. Training throughput (images/s, forward + backward + AdamW step), same weights, same batch,
   same precision (bf16 autocast, also on CPU), the two models interleaved in one run, medians.
2. Top-1 of the core ViT after a fixed small budget through the real engine (``tk.core.engine.train``)
   on the CIFAR-10 image-folder subset in ``../shared/data/cifar10`` (skipped when absent).

    python benchmarks/vit_cifar.py            # full
    python benchmarks/vit_cifar.py --quick    # a smoke run (seconds to minutes)

Prints a table; the last line is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import timm
import torch

from tk.core.nn.vit import VisionTransformer, load_timm_vit

SHAPE = dict(img_size=32, patch_size=4, dim=192, depth=9, num_heads=3, mlp_ratio=2.0)
DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cifar10"


def build_pair(device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(tk ViT, timm ViT) of SHAPE with identical weights."""
    ref = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=SHAPE["img_size"], patch_size=SHAPE["patch_size"],
        embed_dim=SHAPE["dim"], depth=SHAPE["depth"], num_heads=SHAPE["num_heads"],
        mlp_ratio=SHAPE["mlp_ratio"], num_classes=10,
    )
    ours = VisionTransformer(num_classes=10, **SHAPE)
    load_timm_vit(ours, ref)
    return ours.to(device).train(), ref.to(device).train()


def time_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               steps: int) -> float:
    """Seconds for ``steps`` training steps under bf16 autocast."""
    def sync():
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def throughput(device: torch.device, batch: int, steps: int, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    models = dict(zip(("tk", "timm"), build_pair(device)))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randn(batch, 3, SHAPE["img_size"], SHAPE["img_size"], device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    for k in models:  # warm-up: allocator, kernels, optimizer state
        time_steps(models[k], opts[k], x, y, 2)
    rates: dict[str, list[float]] = {k: [] for k in models}
    for rep in range(reps):
        order = list(models) if rep % 2 == 0 else list(models)[::-1]  # alternate who goes first
        for k in order:
            rates[k].append(batch * steps / time_steps(models[k], opts[k], x, y, steps))
    return {k: statistics.median(v) for k, v in rates.items()}


def top1_after_budget(steps: int, batch: int, device: str) -> float | None:
    """val/top1 of the core ViT after ``steps`` updates through ``tk.core.engine.train``."""
    if not (DATA / "train").is_dir():
        print(f"top-1 part skipped: no image folder at {DATA.resolve()} (needs train/<class>/*.jpg)")
        return None
    from tk.core.engine.train import Trainer
    from tk.core.recipe import load_config

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "vit_cifar_cpu.yaml"
    overrides = [
        "data.source=imagefolder", f"data.root={DATA.resolve()}", f"train.max_steps={steps}",
        f"train.batch_size={batch}", "train.eval_every=null", "train.progress=false", f"train.device={device}",
        f"schedule.warmup_steps={max(1, steps // 10)}",
    ] + (["train.precision=bf16", "train.num_workers=8"] if device.startswith("cuda") else [])
    cfg, task_cls = load_config(str(recipe), overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        results = Trainer(cfg, task_cls, Path(run_dir)).fit()
    return results.get("val/top1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that the script works")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    # CPUs without native bf16 (no AVX512-BF16/AMX) emulate it: a few images/s, so keep CPU sizes small
    if args.quick:
        batch, steps, reps = 8, 1, 3
    else:
        batch, steps, reps = (256, 20, 7) if device.type == "cuda" else (32, 3, 5)
    rates = throughput(device, batch, steps, reps)
    ratio = rates["tk"] / rates["timm"]
    if args.quick:
        budget_steps, budget_batch = 10, 16
    else:  # a fixed budget per device kind (CPU: ~10-15 min of training on 2 cores)
        budget_steps, budget_batch = (1500, 128) if device.type == "cuda" else (500, 128)
    top1 = top1_after_budget(budget_steps, budget_batch, args.device)

    print(f"\nViT {SHAPE}, {device}, bf16 autocast, batch {batch}, {steps} steps x {reps} reps (median)")
    print(f"{'model':<8}{'train img/s':>14}")
    for k, v in rates.items():
        print(f"{k:<8}{v:>14.1f}")
    print(f"tk/timm: {ratio:.3f}x (target >= 1.0x)")
    if top1 is not None:
        print(f"top-1 after {budget_steps} updates of {budget_batch} (CIFAR-10 subset, tk ViT): {top1:.4f}")
    print(json.dumps({
        "benchmark": "vit_cifar", "quick": args.quick, "device": str(device), "batch": batch,
        "tk_img_per_s": round(rates["tk"], 2), "timm_img_per_s": round(rates["timm"], 2),
        "tk_vs_timm_speed": round(ratio, 4), "top1": top1, "top1_steps": budget_steps if top1 is not None else None,
    }))


if __name__ == "__main__":
    main()
