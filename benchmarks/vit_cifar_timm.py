"""Reference: timm's way of training ``recipes/vit_cifar10k_gpu.yaml``, at the same budget (issue #38).

A bare loop built from timm's parts, as a timm user writes one for CIFAR: timm's
``VisionTransformer`` of vit_cifar's shape (patch 4, 32 px, 9 blocks, dim 192, 3 heads, mlp 2,
stochastic depth 0.1), torchvision's ``ImageFolder`` and ``DataLoader`` with PIL augmentation in 4
workers (pad-crop 4, flip, timm's RandAugment m9-mstd0.5, timm's pixel RandomErasing 0.25), timm's
``Mixup`` (0.8 / CutMix 1.0, label smoothing 0.1) and ``SoftTargetCrossEntropy``, timm's AdamW
(``create_optimizer_v2``: no decay on norms and biases) and ``CosineLRScheduler`` stepped per update
(390 warm-up updates, lr 1e-3 to 1e-5), bf16 autocast, ``torch.compile``. 150 epochs of 256
(5,850 updates) on the 10k subset of ``../shared/data/cifar10``, evaluated every 1,170 updates as
the recipe is.

Reports val top-1, the training loop's seconds, the process's seconds and the share of the loop
spent waiting for the loader (what tk's ``data_wait`` records).

    python benchmarks/vit_cifar_timm.py --root ../shared/data/cifar10   # on a GPU
    python benchmarks/vit_cifar_timm.py --quick    # a CPU dry run on generated images (part of the suite)

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import timm
import torch
import torchvision.transforms as T
from timm.data import Mixup
from timm.data.auto_augment import rand_augment_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.data.random_erasing import RandomErasing
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import FakeData, ImageFolder

PROCESS_START = time.perf_counter()  # set-up and training; .ci/gpu_session times whole processes
CIFAR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cifar10"
MEAN, STD = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD  # tk's default for image folders


def transforms(size: int) -> tuple[T.Compose, T.Compose]:
    """(train, eval) transforms: the recipe's augmentation, as tk's worker path builds it."""
    hparams = {"translate_const": int(size * 0.45), "img_mean": tuple(round(255 * m) for m in MEAN)}
    train = T.Compose([T.RandomCrop(size, padding=4), T.RandomHorizontalFlip(),
                       rand_augment_transform("rand-m9-mstd0.5", hparams), T.ToTensor(), T.Normalize(MEAN, STD),
                       RandomErasing(0.25, mode="pixel", device="cpu")])
    return train, T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])


def datasets(root: Path | None, quick: bool, size: int):
    """(train, val): the image folder, or generated images for a dry run with no root."""
    train_tf, eval_tf = transforms(size)
    if root is not None and (root / "train").is_dir() and (root / "val").is_dir():
        train, val = ImageFolder(str(root / "train"), train_tf), ImageFolder(str(root / "val"), eval_tf)
        if quick:  # a dry run of the real folder path: 64 + 32 images drawn from it, every class likely
            pick = torch.Generator().manual_seed(0)
            train = Subset(train, torch.randperm(len(train), generator=pick)[:64].tolist())
            val = Subset(val, torch.randperm(len(val), generator=pick)[:32].tolist())
        return train, val
    if root is not None or not quick:
        raise SystemExit(f"vit_cifar_timm: {root} has no train/ and val/ folders; pass --root PATH/cifar10")
    shape = (3, size, size)
    return (FakeData(64, shape, 10, train_tf, random_offset=0), FakeData(32, shape, 10, eval_tf, random_offset=64))


@torch.no_grad()
def top1(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(images.to(device, non_blocking=True))
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None,
                        help="the image folder, train/ and val/ (default: ../shared/data/cifar10; quick: generated, or 64 + 32 images of ROOT)")
    parser.add_argument("--quick", action="store_true", help="a tiny model for two epochs on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=None, help="default 150 (quick 2)")
    parser.add_argument("--workers", type=int, default=4, help="loader workers (the recipe's train.num_workers)")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    epochs = args.epochs or (2 if args.quick else 150)
    batch, eval_every, size = (16, 4, 32) if args.quick else (256, 1170, 32)
    shape = {"embed_dim": 32, "depth": 2, "num_heads": 2} if args.quick else {"embed_dim": 192, "depth": 9, "num_heads": 3}

    train_set, val_set = datasets(args.root or (None if args.quick else CIFAR), args.quick, size)
    workers = 0 if args.quick else args.workers
    cuda = device.type == "cuda"
    train_loader = DataLoader(train_set, batch, shuffle=True, drop_last=True, num_workers=workers, pin_memory=cuda,
                              persistent_workers=workers > 0)
    val_loader = DataLoader(val_set, 1000, num_workers=workers, pin_memory=cuda)
    model = timm.models.VisionTransformer(img_size=size, patch_size=4, mlp_ratio=2.0, num_classes=10,
                                          drop_path_rate=0.1, **shape).to(device)
    forward = model if args.no_compile or args.quick else torch.compile(model)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode="batch", label_smoothing=0.1,
                  num_classes=10)
    criterion = SoftTargetCrossEntropy()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999))
    updates = epochs * len(train_loader)
    warmup = min(390, updates // 10) if not args.quick else 2
    scheduler = CosineLRScheduler(optimizer, t_initial=updates, lr_min=1e-5, warmup_t=warmup, warmup_lr_init=1e-6,
                                  t_in_epochs=False)

    curve: list[tuple[int, float]] = []
    step, waited = 0, 0.0
    loop_start = time.perf_counter()
    for _ in range(epochs):
        fetch = time.perf_counter()
        for images, labels in train_loader:
            waited += time.perf_counter() - fetch
            images, labels = mixup(images.to(device, non_blocking=True), labels.to(device, non_blocking=True))
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = criterion(forward(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            scheduler.step_update(step)
            if step % eval_every == 0 or step == updates:
                # eager, as tk's engine evaluates (compiled, eval mode and batch 1000 compile again)
                curve.append((step, top1(model, val_loader, device)))
                print(f"step {step:5d}  loss {loss.item():.4f}  val top-1 {curve[-1][1]:.4f}  "
                      f"{time.perf_counter() - loop_start:6.1f} s", flush=True)
            fetch = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    loop_s, wall_s = time.perf_counter() - loop_start, time.perf_counter() - PROCESS_START
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"\ntimm ViT loop ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters), {updates} updates "
          f"of {batch}, {workers} loader workers, bf16{'' if forward is model else ', compiled'}, {name}")
    print(f"  val top-1 {curve[-1][1]:.4f}   loop {loop_s:.1f} s   process {wall_s:.1f} s   "
          f"waiting for data {100 * waited / loop_s:.1f}% of the loop")
    print(json.dumps({"benchmark": "vit_cifar_timm", "device": name, "torch": torch.__version__, "timm": timm.__version__,
                      "updates": updates, "top1": round(curve[-1][1], 4), "curve": [[s, round(v, 4)] for s, v in curve],
                      "loop_s": round(loop_s, 1), "wall_s": round(wall_s, 1), "data_wait": round(waited / loop_s, 3)}))


if __name__ == "__main__":
    main()
