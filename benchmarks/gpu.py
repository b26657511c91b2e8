"""Benchmark: tk on one GPU beside its references, in one prepared script (issue #38).

Every section measures tk and a reference in the same process, interleaved (random order per
repetition, one warm-up each, compilation included in the warm-up), medians:

1. ``vit``: ViT training images/s, tk's core ViT against timm's ``VisionTransformer`` of the same
   shape and weights, bf16 autocast, eager and ``torch.compile``d, at CIFAR size (``vit_cifar``'s
   shape: patch 4, 32 px, DeiT-Tiny width) and ImageNet size (ViT-S/16, 224 px).
2. ``lm``: language-model training tokens/s and MFU at GPT-2-small shape (block 1024, vocabulary
   50304, tied embeddings): tk's engine (``Trainer.fit``: AdamW, clipping at 1.0, bf16, compiled)
   against a bare nanoGPT-style loop on the same model, batches and optimiser. MFU counts
   6 N + 12 L D T FLOPs per token (nanoGPT's ``estimate_mfu``) against the GPU's dense bf16 peak.
3. ``translation``: encoder-decoder training target tokens/s, tk's ``EncoderDecoder`` against
   ``nn.Transformer`` of the same size (``benchmarks/translation.py``'s reference) on the same
   token-budget batches, bf16.
4. ``generation``: greedy decoding tokens/s with the KV cache at batch 1 and 16, tk's
   ``generate`` against a minimal cached decoder (``benchmarks/generation.py``'s reference,
   sharing tk's weights), bf16; both must give the same tokens.
5. ``data``: ``vit_cifar``'s training step fed by its real loader against the same step on one
   batch already on the device (the starvation ratio: 1.0 = the loader keeps up), for the PIL
   worker path and for ``data.pipeline: device``, each with and without RandAugment. CIFAR-10 from
   ``../shared/data/cifar10`` when it is there, else generated shapes.

    python benchmarks/gpu.py                 # on a GPU: an estimated 4-5 minutes, most of it compilation
    python benchmarks/gpu.py --partial F     # also F: the JSON of the sections done so far, after each one
    python benchmarks/gpu.py --only vit,lm   # some sections (all: lm, vit, data, translation, generation)
    python benchmarks/gpu.py --quick         # CPU dry run of every section (tiny shapes; part of the suite)

Prints a table per section; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import timm
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks' references

from generation import ReferenceLM, reference_greedy, share_parameters  # noqa: E402
from translation import PAD, ReferenceSeq2Seq, make_batches  # noqa: E402

from tk.core.data.loader import LoaderSpec  # noqa: E402
from tk.core.engine.train import Trainer  # noqa: E402
from tk.core.losses import cross_entropy_sum  # noqa: E402
from tk.core.nn.config import TransformerConfig  # noqa: E402
from tk.core.nn.generation import GenerationConfig, generate  # noqa: E402
from tk.core.nn.transformer import DecoderOnlyLM, EncoderDecoder  # noqa: E402
from tk.core.nn.vit import VisionTransformer, load_timm_vit  # noqa: E402
from tk.core.optim import build_optimizer  # noqa: E402
from tk.core.recipe import load_config  # noqa: E402
from tk.core.schedule import build_scheduler  # noqa: E402
from tk.core.task import StepOutput, Task  # noqa: E402
from tk.core.training.device import move_to_device  # noqa: E402

SECTIONS = ("lm", "vit", "data", "translation", "generation")  # the order of the goals, should time run out
CIFAR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cifar10"
# Dense bf16 peaks from the vendors' sheets (FLOP/s); --peak-tflops overrides
PEAKS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12,
         "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, Callable[[], Any]], reps: int, calls: int, device: torch.device,
                warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function: ``warmup`` calls each (compilation happens
    there), then ``reps`` rounds in random order, each timing ``calls`` calls."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name in random.sample(list(fns), len(fns)):
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            sync(device)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in times.items()}


def compiled(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    """``torch.compile`` with static shapes (the eager backend in ``--quick``: the same tracing, no
    code generation). Static, because dynamo's cache belongs to the class's ``forward``: a second
    shape of the same class would otherwise be compiled again with symbolic sizes."""
    return torch.compile(model, backend="eager" if args.quick else "inductor", dynamic=False)


def train_step(model: torch.nn.Module, forward: Callable, make_loss: Callable, device: torch.device) -> Callable:
    """One bf16 training step (forward, loss, backward, AdamW, zero) as a closure."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = make_loss(forward)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# -- 1. ViT --------------------------------------------------------------------------
def vit_pair(shape: dict[str, Any], classes: int, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(tk ViT, timm ViT) of ``shape`` with the same weights."""
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=shape["img_size"],
                            patch_size=shape["patch_size"], embed_dim=shape["dim"], depth=shape["depth"],
                            num_heads=shape["num_heads"], mlp_ratio=shape["mlp_ratio"], num_classes=classes)
    ours = VisionTransformer(num_classes=classes, **shape)
    load_timm_vit(ours, ref)
    return ours.to(device).train(), ref.to(device).train()


def bench_vit(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shapes = {  # name: (shape, batch, classes)
        "cifar": (dict(img_size=32, patch_size=4, dim=192, depth=9, num_heads=3, mlp_ratio=2.0), 256, 10),
        "imagenet": (dict(img_size=224, patch_size=16, dim=384, depth=12, num_heads=6, mlp_ratio=4.0), 128, 1000),
    }
    if args.quick:
        shapes = {"cifar": (dict(img_size=32, patch_size=8, dim=32, depth=2, num_heads=2, mlp_ratio=2.0), 8, 10),
                  "imagenet": (dict(img_size=64, patch_size=16, dim=32, depth=2, num_heads=2, mlp_ratio=2.0), 4, 10)}
    result: dict[str, Any] = {}
    for name, (shape, batch, classes) in shapes.items():
        torch._dynamo.reset()  # each shape compiled afresh, not as a recompile of the last
        torch.manual_seed(0)
        x = torch.randn(batch, 3, shape["img_size"], shape["img_size"], device=device)
        y = torch.randint(0, classes, (batch,), device=device)
        fns = {}
        for label, model in zip(("tk", "timm"), vit_pair(shape, classes, device)):
            for mode in args.modes:
                forward = compiled(model, args) if mode == "compiled" else model
                fns[f"{label} {mode}"] = train_step(model, forward, lambda f: F.cross_entropy(f(x).float(), y), device)
        seconds = interleaved(fns, args.reps, args.calls, device)
        rates = {k: batch / v for k, v in seconds.items()}
        result[name] = {"batch": batch, "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                        "tk_vs_timm": {m: round(rates[f"tk {m}"] / rates[f"timm {m}"], 3) for m in args.modes}}
        print(f"\nViT {name} ({shape['img_size']} px, patch {shape['patch_size']}, dim {shape['dim']}, "
              f"depth {shape['depth']}), batch {batch}, bf16")
        for k, v in rates.items():
            print(f"  {k:18s} {v:12,.0f} img/s")
    return result


# -- 2. LM: the engine against a bare loop ---------------------------------------------
@dataclass
class TokenData:
    num_train: int = 256  # sequences of random tokens
    block_size: int = 1024  # tokens per sequence (inputs; targets are shifted by one)
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT


class GPTBench(Task):
    """Next-token prediction on random tokens with tk's decoder-only LM (the model: ``model:``)."""

    name = "gpt_bench"
    DataConfig = TokenData
    ModelConfig = TransformerConfig

    def build_dataset(self, split: str) -> TensorDataset:
        d = self.data
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = d.num_train if split == "train" else 1
        return TensorDataset(torch.randint(0, d.vocab_size, (n, d.block_size + 1), generator=generator))

    def collate(self, samples: list) -> dict[str, torch.Tensor]:
        return {"tokens": torch.stack([s[0] for s in samples])}

    def build_model(self) -> DecoderOnlyLM:
        return DecoderOnlyLM(self.model_cfg, self.data.vocab_size)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
        return StepOutput(loss=loss, num_items=tokens[:, 1:].numel())


def lm_config(args: argparse.Namespace, device: torch.device, steps: int, folder: Path):
    dim, depth, heads, block, batch = (768, 12, 12, 1024, 16) if not args.quick else (32, 2, 2, 32, 4)
    recipe = folder / "gpt_bench.yaml"
    recipe.write_text(
        f"task: gpt_bench\ndata: {{block_size: {block}, vocab_size: {50304 if not args.quick else 256}}}\n"
        f"model: {{dim: {dim}, depth: {depth}, num_heads: {heads}, dropout: 0.0, pos_encoding: learned, "
        f"max_len: {block}, tie_embeddings: true}}\n"
        f"optim: {{name: adamw, lr: 6.0e-4, weight_decay: 0.1, betas: [0.9, 0.95], fused: {device.type == 'cuda'}}}\n"
        f"train: {{max_steps: {steps}, batch_size: {batch}, eval_batch_size: 1, eval_every: {steps}, "
        f"precision: bf16, compile: {not args.quick}, device: {device}, clip_grad_norm: 1.0, log_every: 10, "
        f"progress: false, seed: 0}}\n")
    cfg, _ = load_config(recipe, task_loader=lambda _name: GPTBench)
    return cfg


class StepTimes:
    """When each optimizer step ends. On a GPU a CUDA event recorded in the stream, read after the
    run: the loop is not synchronised by the measurement, so it keeps its own CPU/GPU overlap (a
    bare loop never waits for the GPU; the engine waits once per step, which then counts)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.device, self.marks = device, []
        optimizer.register_step_post_hook(self.mark)

    def mark(self, *_: Any) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive step ends."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def run_engine(cfg) -> list[float]:
    """Seconds between the optimizer steps of ``Trainer.fit()``."""
    trainer = Trainer(cfg, GPTBench, run_dir=None)
    times = StepTimes(trainer.optimizer, trainer.device)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit()
    return times.intervals()


def run_bare(cfg, device: torch.device) -> list[float]:
    """Seconds between the optimizer steps of nanoGPT's loop on the same model, batches (the
    engine's loader order) and optimiser groups."""
    t = cfg.train
    task = GPTBench(cfg)
    loader = task.build_loader("train", LoaderSpec(batch_size=t.batch_size, shuffle=True, drop_last=True, seed=t.seed,
                                                   pin_memory=device.type == "cuda"))
    torch.manual_seed(t.seed)
    model = task.build_model().to(device).train()
    forward = torch.compile(model) if t.compile else model
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, t.max_steps)
    times = StepTimes(optimizer, device)
    step = 0
    while step < t.max_steps:
        for batch in loader:
            tokens = batch["tokens"].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = forward(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % t.log_every == 0:
                loss.item()
            if step == t.max_steps:
                break
    return times.intervals()


def peak_flops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    if override:
        return override * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "no GPU"
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAKS.items():  # the more specific names come first
        if key in name:
            return flops, key
    return None, f"unknown peak for {name}"


def bench_lm(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    steps, skip = (4, 1) if args.quick else (args.lm_steps, 10)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = lm_config(args, device, steps, Path(tmp))
        intervals: dict[str, list[float]] = {"tk engine": [], "bare loop": []}
        for _ in range(args.lm_rounds):  # engine and bare alternate, in random order
            for name in random.sample(list(intervals), 2):
                times = run_engine(cfg) if name == "tk engine" else run_bare(cfg, device)
                intervals[name] += times[skip:]  # the first steps compile and warm up
    m, d = cfg.sections["model"], cfg.sections["data"]
    model = DecoderOnlyLM(m, d.vocab_size)
    params = sum(p.numel() for p in model.parameters()) - m.max_len * m.dim  # without positions, as nanoGPT
    tokens_per_step = cfg.train.batch_size * d.block_size
    flops_per_token = 6 * params + 12 * m.depth * m.dim * d.block_size
    peak, peak_name = peak_flops(device, args.peak_tflops)
    result: dict[str, Any] = {"params": params, "tokens_per_step": tokens_per_step, "peak": peak_name}
    print(f"\nLM (GPT-2-small shape: {params / 1e6:.0f} M parameters without positions), {tokens_per_step} tokens "
          f"per step, bf16{', compiled' if cfg.train.compile else ''}")
    for name, values in intervals.items():
        rate = tokens_per_step / statistics.median(values)
        mfu = rate * flops_per_token / peak if peak else None
        result[name] = {"tokens_per_s": round(rate), "mfu": None if mfu is None else round(mfu, 4)}
        print(f"  {name:12s} {rate:12,.0f} tok/s   MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} ({peak_name})")
    result["engine_vs_bare"] = round(result["tk engine"]["tokens_per_s"] / result["bare loop"]["tokens_per_s"], 3)
    return result


# -- 3. translation ------------------------------------------------------------------
def bench_translation(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    if args.quick:
        cfg = TransformerConfig(dim=32, depth=1, num_heads=2, hidden_dim=64, dropout=0.1, max_len=128,
                                share_embeddings=True)
        vocab, pairs, max_tokens = 300, 200, 512
    else:  # Transformer-base (Vaswani et al. 2017): the transformer_base_wmt14 recipe's model
        cfg = TransformerConfig(dim=512, depth=6, num_heads=8, hidden_dim=2048, dropout=0.1, max_len=256,
                                share_embeddings=True)
        vocab, pairs, max_tokens = 32000, 20000, 12000
    batches = [move_to_device(b, device) for b in make_batches(pairs, vocab, max_tokens, seed=0)[:8]]
    torch.manual_seed(0)
    models = {"tk": EncoderDecoder(cfg, vocab, vocab, pad_id=PAD).to(device).train(),
              "nn.Transformer": ReferenceSeq2Seq(cfg, vocab).to(device).train()}
    position = {"i": 0}

    def loss_of(model: torch.nn.Module) -> Callable:
        def make_loss(forward: Callable) -> torch.Tensor:
            b = batches[position["i"] % len(batches)]
            position["i"] += 1
            loss, n = cross_entropy_sum(forward(b["src"], b["tgt_in"]).float(), b["tgt_out"], label_smoothing=0.1,
                                        ignore_index=PAD)
            return loss / n
        return make_loss
    fns = {name: train_step(model, model, loss_of(model), device) for name, model in models.items()}
    seconds = interleaved(fns, args.reps, len(batches), device)
    tokens = statistics.mean(int(b["tgt_out"].ne(PAD).sum()) for b in batches)
    rates = {k: tokens / v for k, v in seconds.items()}
    print(f"\nTranslation (dim {cfg.dim}, {cfg.depth}+{cfg.depth} layers, vocab {vocab}), ~{tokens:.0f} target "
          f"tokens per batch, bf16")
    for k, v in rates.items():
        print(f"  {k:18s} {v:12,.0f} target tok/s")
    return {"tokens_per_s": {k: round(v) for k, v in rates.items()},
            "tk_vs_nn_transformer": round(rates["tk"] / rates["nn.Transformer"], 3)}


# -- 4. generation -------------------------------------------------------------------
@torch.no_grad()
def bench_generation(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dim, depth, heads, new = (768, 12, 12, 128) if not args.quick else (32, 2, 2, 8)
    vocab = 50304 if not args.quick else 256
    torch.manual_seed(0)
    gpt = TransformerConfig(dim=dim, depth=depth, num_heads=heads, dropout=0.0, activation="gelu", norm_first=True,
                            pos_encoding="learned", max_len=1024)
    model = DecoderOnlyLM(gpt, vocab).to(device).eval()
    reference = ReferenceLM(vocab, dim, depth, heads, max_len=1024).to(device).eval()
    share_parameters(reference, model)
    result: dict[str, Any] = {"new_tokens": new}
    print(f"\nGeneration (GPT-2-small shape{' (tiny)' if args.quick else ''}), greedy, {new} new tokens after 16, "
          f"KV cache, bf16")
    for batch in (1, 16):
        prompt = torch.randint(3, vocab, (batch, 16), device=device)
        gen = GenerationConfig(strategy="greedy", max_len=new, use_cache=True)

        def ours() -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return generate(model, prompt, gen).tokens

        def theirs() -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return reference_greedy(reference, prompt, new, True)
        seconds = interleaved({"tk": ours, "reference": theirs}, args.reps, 1, device, warmup=1)
        same = bool(torch.equal(ours()[:, -new:], theirs()))
        rates = {k: batch * new / v for k, v in seconds.items()}
        result[f"batch_{batch}"] = {"tokens_per_s": {k: round(v) for k, v in rates.items()},
                                    "tk_vs_reference": round(rates["tk"] / rates["reference"], 3), "same_tokens": same}
        print(f"  batch {batch:2d}: tk {rates['tk']:10,.0f} tok/s, reference {rates['reference']:10,.0f} tok/s"
              f" ({'same tokens' if same else 'TOKENS DIFFER'})")
    return result


# -- 5. the data path ------------------------------------------------------------------
def bench_data(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    real = args.data_root.is_dir() and not args.quick
    data = ["data.source=imagefolder", f"data.root={args.data_root.resolve()}"] if real else \
        ["data.source=synthetic", f"data.num_train={512 if args.quick else 20000}", "data.num_val=64"]
    if args.quick:
        data += ["model.dim=32", "model.depth=1", "model.num_heads=2"]
    workers = 0 if args.quick else min(8, os.cpu_count() or 1)
    variants = {"workers, RandAugment (recipe)": ["data.pipeline=workers"],
                "workers, no RandAugment": ["data.pipeline=workers", "data.auto_augment=null"],
                "device pipeline, no RandAugment": ["data.pipeline=device", "data.auto_augment=null"],
                "device pipeline, RandAugment (recipe)": ["data.pipeline=device"]}
    batch, steps = (8, 3) if args.quick else (128, args.data_steps)
    result: dict[str, Any] = {"data": "cifar10_subset" if real else "synthetic", "loader_workers": workers}
    print(f"\nData path: vit_cifar's step (bf16{', compiled' if 'compiled' in args.modes else ''}, batch {batch}), "
          f"fed by its loader ({workers} workers) vs one batch resident on the device; "
          f"{'CIFAR-10 subset' if real else 'generated shapes'}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants.items():
            cfg, task_cls = load_config("vit_cifar", [*data, *overrides, f"output_dir={tmp}/run",
                                                      f"train.batch_size={batch}"])
            task = task_cls(cfg)
            torch.manual_seed(0)
            model = task.build_model().to(device).train()
            forward = compiled(model, args) if "compiled" in args.modes else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            loader = task.build_loader("train", LoaderSpec(batch_size=batch, shuffle=True, drop_last=True, seed=0,
                                                           num_workers=workers, pin_memory=device.type == "cuda"))

            def step(host_batch: dict) -> None:
                b = move_to_device(host_batch, device)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    b = task.transform_batch(b, training=True)
                    out = task.loss(forward, b)
                (out.loss / out.num_items).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            it = iter(loader)
            resident = move_to_device(next(it), device)
            for _ in range(3):  # compile and warm up
                step(resident)
            times: dict[str, list[float]] = {"fed": [], "resident": []}
            for _ in range(args.reps):  # fed and resident alternate
                sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    host_batch = next(it, None)
                    if host_batch is None:  # a new pass: new workers, as in training
                        it = iter(loader)
                        host_batch = next(it)
                    step(host_batch)
                sync(device)
                times["fed"].append((time.perf_counter() - start) / steps)
                start = time.perf_counter()
                for _ in range(steps):
                    step(resident)
                sync(device)
                times["resident"].append((time.perf_counter() - start) / steps)
            fed_s, res_s = statistics.median(times["fed"]), statistics.median(times["resident"])
            result[name] = {"images_per_s_fed": round(batch / fed_s), "images_per_s_resident": round(batch / res_s),
                            "starvation": round(fed_s / res_s, 3)}
            print(f"  {name:38s} fed {batch / fed_s:10,.0f} img/s, resident {batch / res_s:10,.0f} img/s, "
                  f"starvation {fed_s / res_s:.2f}")
    return result


BENCHES = {"vit": bench_vit, "lm": bench_lm, "translation": bench_translation, "generation": bench_generation,
           "data": bench_data}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks that every section runs")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per section (default 3; quick 1)")
    parser.add_argument("--calls", type=int, default=None, help="steps per timed round (default 10; quick 1)")
    parser.add_argument("--lm-steps", type=int, default=50, help="updates per LM run (the first 10 are not timed)")
    parser.add_argument("--lm-rounds", type=int, default=1, help="engine and bare-loop runs each, alternating")
    parser.add_argument("--data-steps", type=int, default=30, help="steps per data-path round")
    parser.add_argument("--data-root", type=Path, default=CIFAR, help="the CIFAR-10 image folder (train/, val/)")
    parser.add_argument("--no-compile", action="store_true", help="eager only (compiled rows skipped)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak for the MFU")
    parser.add_argument("--partial", type=Path, default=None,
                        help="write the JSON of the sections done so far here after each one (kept if time runs out)")
    args = parser.parse_args()
    args.reps = args.reps or (1 if args.quick else 3)
    args.calls = args.calls or (1 if args.quick else 10)
    args.modes = ("eager",) if args.no_compile else ("eager", "compiled")
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown sections {unknown}; choose from {SECTIONS}")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    random.seed(0)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    print(f"device: {gpu}; torch {torch.__version__}; timm {timm.__version__}; {time.strftime('%Y-%m-%d')}")
    results: dict[str, Any] = {"benchmark": "gpu", "device": gpu, "torch": torch.__version__, "quick": args.quick}
    failed = []
    for name in sections:
        start = time.perf_counter()
        torch._dynamo.reset()  # no section inherits another's compiled code or recompile counts
        try:
            results[name] = BENCHES[name](args, device)
        except Exception as error:  # one broken section must not cost the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            failed.append(name)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"  ({name}: {results[name]['seconds']:.0f} s)")
        if args.partial:
            args.partial.write_text(json.dumps(results) + "\n")
    print(json.dumps(results))
    if failed:
        sys.exit(f"sections that failed: {', '.join(failed)} (tracebacks above)")


if __name__ == "__main__":
    main()
