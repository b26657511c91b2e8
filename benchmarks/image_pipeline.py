"""Benchmark: ``data.pipeline: device`` against the PIL worker path on CPU (issue #38 item 3).

The ``vit_cifar`` recipe's training augmentation (pad-4 random crop, flip, ToTensor + Normalize,
random erasing 0.25), without and with its RandAugment (rand-m9-mstd0.5), without Mixup/CutMix
(the same timm code on the batch in both paths), on the
CIFAR-10 image-folder subset in ``../shared/data/cifar10`` (generated shapes when absent or with
``--quick``):

1. Augmentation cost per image on one thread: the worker path's per-image transform plus
   collation of a batch of 128 (what each loader worker does), against the device pipeline's
   batch gather plus :class:`BatchAugment` on the CPU.
2. Delivered images/s of the real training loaders (``train.num_workers=2`` workers decoding
   and augmenting, against the decoded split gathered and augmented in the main process on
   2 threads), each batch through ``transform_batch`` (where the device pipeline augments).

Variants run interleaved (random order per repetition); medians over repetitions.
Target: the device pipeline beats the worker path per image.

    python benchmarks/image_pipeline.py --quick   # smoke run on generated shapes (seconds)
    python benchmarks/image_pipeline.py           # the CIFAR-10 subset (a minute or two)

Prints a table; the last line is one JSON object with the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import default_collate

from tk.core.data import LoaderSpec
from tk.core.recipe import load_config
from tk.plugins.image_classification.data import build_source_dataset

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cifar10"
BATCH = 128


def cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_task(data: list[str], pipeline: str, auto_augment: str | None, folder: Path):
    overrides = [*data, f"data.pipeline={pipeline}", f"data.auto_augment={auto_augment or 'null'}",
                 "mixup.prob=0", f"output_dir={folder}"]
    cfg, task_cls = load_config(str(RECIPES / "vit_cifar.yaml"), overrides)
    return task_cls(cfg)


def per_image_variants(tasks: dict, images: list, decoded, batches: int) -> dict[str, Callable[[], float]]:
    """Seconds per image of each way to augment ``batches`` batches of BATCH images (one thread)."""
    def workers(task) -> Callable[[], float]:
        transform = task._transform(training=True)

        def run() -> float:
            start = time.perf_counter()
            for b in range(batches):
                chunk = images[b * BATCH % len(images):][:BATCH]
                default_collate([{"image": transform(img), "labels": 0} for img in chunk])
            return (time.perf_counter() - start) / (batches * BATCH)
        return run

    def device(task) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(batches):
                index = torch.randint(0, len(decoded), (BATCH,)).tolist()
                task.transform_batch(decoded.__getitems__(index), training=True)
            return (time.perf_counter() - start) / (batches * BATCH)
        return run
    return {"workers (PIL)": workers(tasks["workers"]), "workers + RandAugment": workers(tasks["randaugment"]),
            "device pipeline": device(tasks["device"]),
            "device + RandAugment": device(tasks["device_randaugment"])}


def delivered_variants(tasks: dict, batches: int) -> dict[str, Callable[[], float]]:
    """Images/s of the real training loaders (2 workers vs the decoded split), through transform_batch."""
    def loader_rate(task, workers: int) -> Callable[[], float]:
        loader = task.build_loader("train", LoaderSpec(batch_size=BATCH, shuffle=True, drop_last=True, seed=0,
                                                       num_workers=workers))

        def run() -> float:
            it = iter(loader)
            next(it)  # the workers' start-up is not the steady rate
            start = time.perf_counter()
            for _, batch in zip(range(batches), it):
                task.transform_batch(batch, training=True)
            return batches * BATCH / (time.perf_counter() - start)
        return run
    return {"workers (PIL), 2 workers": loader_rate(tasks["workers"], 2),
            "device pipeline, 2 threads": loader_rate(tasks["device"], 0),
            "workers + RandAugment, 2 workers": loader_rate(tasks["randaugment"], 2),
            "device + RandAugment, 2 threads": loader_rate(tasks["device_randaugment"], 0)}


def interleaved(variants: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name in random.sample(list(variants), len(variants)):
            results[name].append(variants[name]())
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="generated shapes, few repetitions")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    real = DATA.is_dir() and not args.quick
    data = ["data.source=imagefolder", f"data.root={DATA.resolve()}"] if real else \
        ["data.source=synthetic", "data.num_train=1024", "data.num_val=64"]
    reps = args.reps or (2 if args.quick else 7)
    batches = 2 if args.quick else 20
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = {"workers": make_task(data, "workers", None, Path(tmp) / "w"),
                 "randaugment": make_task(data, "workers", "rand-m9-mstd0.5", Path(tmp) / "r"),
                 "device": make_task(data, "device", None, Path(tmp) / "d"),
                 "device_randaugment": make_task(data, "device", "rand-m9-mstd0.5", Path(tmp) / "dr")}
        decoded = tasks["device"].build_dataset("train")
        source = build_source_dataset(tasks["workers"].data, "train", None)  # PIL images, held in memory
        images = [source[i][0].convert("RGB") for i in range(BATCH * 4)]
        torch.set_num_threads(1)
        per_image = interleaved(per_image_variants(tasks, images, decoded, batches), reps)
        torch.set_num_threads(2)
        delivered = interleaved(delivered_variants(tasks, batches * 2), reps)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; "
          f"data: {'CIFAR-10 subset (image folder)' if real else 'generated shapes'}; batches of {BATCH}")
    print(f"{'augmentation, one thread':32s} {'us/image':>10s} {'vs device':>10s}")
    for name, seconds in per_image.items():
        print(f"{name:32s} {seconds * 1e6:10.1f} {seconds / per_image['device pipeline']:9.1f}x")
    print(f"{'training loader + transform_batch':32s} {'images/s':>10s}")
    for name, rate in delivered.items():
        print(f"{name:32s} {rate:10.0f}")
    speedup = per_image["workers (PIL)"] / per_image["device pipeline"]
    print(json.dumps({"benchmark": "image_pipeline", "data": "cifar10_subset" if real else "synthetic",
                      "device_vs_pil_per_image": round(speedup, 2),
                      "device_vs_pil_randaugment_per_image":
                          round(per_image["workers + RandAugment"] / per_image["device + RandAugment"], 2),
                      "us_per_image": {k: round(v * 1e6, 1) for k, v in per_image.items()},
                      "delivered_images_per_s": {k: round(v) for k, v in delivered.items()},
                      "delivered_ratio": round(delivered["device pipeline, 2 threads"]
                                               / delivered["workers (PIL), 2 workers"], 2),
                      "delivered_ratio_randaugment": round(delivered["device + RandAugment, 2 threads"]
                                                           / delivered["workers + RandAugment, 2 workers"], 2)}))


if __name__ == "__main__":
    main()
