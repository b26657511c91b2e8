"""Benchmark: sequence packing for text classification (``data.pack``, issue #36 item 4).

1. The fraction of padded tokens in training batches: text classification on SST-2 (random
   batches of 64, padded to the longest) and translation on Multi30k (token-budget batches
   by length), through the recipes' own loaders. Packing is for batches above 20%.
2. Training speed of the ``sst2`` recipe's model on SST-2, padded batches against the same
   batches packed into rows of ``data.max_len`` tokens (block-diagonal attention, positions
   restarting per sentence): real (non-pad) tokens per second, forward + backward + AdamW,
   the same 64 sentences per update. Variants interleaved (random order per repetition),
   medians. Checks that the packed batch's loss equals the padded batch's (eval mode).

    python benchmarks/packing.py --quick     # smoke run on generated sentences (seconds)
    python benchmarks/packing.py             # SST-2 and Multi30k from ../shared/data

Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tk.core.recipe import load_config
from tk.core.training.build import split_loader

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def build_task(recipe: str, overrides: list[str], folder: Path):
    cfg, task_cls = load_config(recipe, [*overrides, f"output_dir={folder}"])
    task = task_cls(cfg, folder)
    task.setup()
    return cfg, task


def pad_fraction(cfg, task, fields: list[str], batches: int = 200) -> dict[str, float]:
    loader = split_loader(task, "train", cfg.train, True, 0, 1, torch.device("cpu"))
    counts = {f: [0, 0] for f in fields}
    for n, batch in enumerate(loader):
        for f in fields:
            counts[f][0] += int((batch[f] == task.pad_id).sum())
            counts[f][1] += batch[f].numel()
        if n + 1 == batches:
            break
    return {f: pad / total for f, (pad, total) in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="generated sentences, 1 repetition, 3 updates")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--updates", type=int, default=20)
    args = parser.parse_args()
    reps, updates = (1, 3) if args.quick else (args.reps, args.updates)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            cfg, task = build_task("textcls_synthetic", ["data.num_train=2000", "data.num_val=64",
                                                         "train.num_workers=0"], Path(tmp) / "tc")
        else:
            cfg, task = build_task("sst2", [f"data.train_file={DATA / 'sst2/train.tsv'}",
                                            f"data.val_file={DATA / 'sst2/dev.tsv'}", "train.num_workers=0"],
                                   Path(tmp) / "tc")
        fractions = {"text classification": pad_fraction(cfg, task, ["input_ids"])["input_ids"]}
        if not args.quick:
            tcfg, ttask = build_task("translation_multi30k_cpu", [f"data.train_prefix={DATA / 'multi30k/train'}",
                                                                  f"data.val_prefix={DATA / 'multi30k/val'}",
                                                                  "train.num_workers=0"], Path(tmp) / "tr")
            both = pad_fraction(tcfg, ttask, ["src", "tgt_in"])
            fractions.update({"translation (source)": both["src"], "translation (target)": both["tgt_in"]})
        model = task.build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train = task.build_dataset("train")
        items = [train[i] for i in range(len(train))]
        random.Random(0).shuffle(items)
        size = cfg.train.batch_size
        batches = [items[i * size:(i + 1) * size] for i in range(updates)]
        padded = [task.collate(b) for b in batches]
        task.data.pack = True
        packed = [task.collate(b) for b in batches]
        real = sum(int((b["input_ids"] != task.pad_id).sum()) for b in padded)
        packed_fraction = 1 - real / sum(b["input_ids"].numel() for b in packed)
        model.eval()
        with torch.no_grad():
            same = abs(task.loss(model, padded[0]).loss.item() - task.loss(model, packed[0]).loss.item()) < 1e-3
        model.train()
        times: dict[str, list[float]] = {"padded": [], "packed": []}
        for _ in range(reps):
            order = list(times)
            random.shuffle(order)
            for name in order:
                start = time.perf_counter()
                for batch in padded if name == "padded" else packed:
                    opt.zero_grad(set_to_none=True)
                    task.loss(model, batch).loss.backward()
                    opt.step()
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"padded tokens per training batch ({os.cpu_count()} cores):")
    for name, f in fractions.items():
        print(f"  {name:<24} {f:6.1%}{'   -> pack' if f > 0.2 else ''}")
    print(f"  text classification, packed {packed_fraction:6.1%}")
    print(f"{'variant':<8} {'seconds':>8} {'real tokens/s':>14}   ({updates} updates of {size} sentences, median of {reps})")
    for name in times:
        print(f"{name:<8} {med[name]:>8.3f} {real / med[name]:>14,.0f}")
    speedup = med["padded"] / med["packed"]
    print(f"packed / padded: {speedup:.2f}x; same loss: {same}")
    print(json.dumps({"benchmark": "packing", "pad_fraction": {k: round(v, 3) for k, v in fractions.items()},
                      "pad_fraction_packed": round(packed_fraction, 3), "speedup": round(speedup, 2),
                      "same_loss": same}))


if __name__ == "__main__":
    main()
