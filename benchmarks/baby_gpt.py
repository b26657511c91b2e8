"""Reference: nanoGPT's Shakespeare-char "baby GPT" as a bare training loop, for
``recipes/lm_shakespeare_char_gpu.yaml`` (issue #38: val/loss <= 1.47 in less wall time than this).

Everything here is plain PyTorch in nanoGPT's style, independent of tk: characters sorted into a
vocabulary, a uint16 token array, random 256-character blocks drawn per step, nanoGPT's GPT (pre-LN
blocks, GELU MLP, LayerNorm without biases, learned positions, tied embeddings, 0.02 init with the
residual projections scaled by 1/sqrt(2 L)), AdamW with weight decay on the 2-D weights only (fused on
CUDA), linear warm-up then cosine to ``min_lr``, clipping at 1.0, bf16 autocast, ``torch.compile``.
Its config is nanoGPT's ``config/train_shakespeare_char.py``.

The validation loss is measured as tk's recipe measures it, so the two numbers compare: the last 10%
of the characters, every non-overlapping 256-character block of it, the mean over all predicted
characters (nanoGPT itself averages 200 random batches of the same 10%).

    python benchmarks/baby_gpt.py --data ../shared/data/tinyshakespeare/input.txt   # on a GPU: ~2-3 min
    python benchmarks/baby_gpt.py --quick     # a CPU dry run on generated text (part of the suite)

Prints the loss curve and a table; the last line is one JSON object (val loss, seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PROCESS_START = time.perf_counter()  # set-up and training; .ci/gpu_session times whole processes
SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare" / "input.txt"


@dataclass
class Config:
    """nanoGPT's config/train_shakespeare_char.py."""

    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    dropout: float = 0.2
    batch_size: int = 64
    max_iters: int = 5000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_every: int = 500  # as the tk recipe's train.eval_every
    log_every: int = 250
    val_fraction: float = 0.1
    eval_batch_size: int = 128


class SelfAttention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=False)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=False)
        self.attn = SelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=False), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model (bias=False), written out again."""

    def __init__(self, c: Config, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=False)
        self.lm_head = nn.Linear(c.n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp.2.weight")):  # residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def load_text(path: Path | None, quick: bool) -> str:
    """The corpus; with no path in a dry run, generated text."""
    if path is not None and path.is_file():
        return path.read_text(encoding="utf-8")
    if path is not None or not quick:
        raise SystemExit(f"baby_gpt: {path} not found; pass --data PATH/input.txt (tiny Shakespeare)")
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(600))


def lr_at(it: int, c: Config) -> float:
    """nanoGPT's get_lr: linear warm-up, cosine decay to min_lr at lr_decay_iters."""
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it > c.lr_decay_iters:
        return c.min_lr
    ratio = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


def make_optimizer(model: GPT, c: Config, device: torch.device) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: decay the matrices and embeddings, not the norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=c.learning_rate, betas=(c.beta1, c.beta2), fused=device.type == "cuda")


@torch.no_grad()
def val_loss(model: nn.Module, val: np.ndarray, c: Config, device: torch.device) -> float:
    """Mean loss over every non-overlapping block of the validation characters (tk's val/loss)."""
    model.eval()
    starts = range(0, len(val) - c.block_size, c.block_size)
    total, count = 0.0, 0
    for i in range(0, len(starts), c.eval_batch_size):
        chunk = torch.stack([torch.from_numpy(val[s: s + c.block_size + 1].astype(np.int64))
                             for s in starts[i: i + c.eval_batch_size]]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None,
                        help="the corpus (default: tiny Shakespeare's input.txt in ../shared/data; quick: generated)")
    parser.add_argument("--quick", action="store_true", help="a tiny model for a few steps on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="updates (default 5000; quick 60)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="override Config fields, e.g. --set n_layer=4 batch_size=32 (nanoGPT's configurator)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    c = Config()
    if args.quick:
        c = Config(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0, batch_size=16, max_iters=60,
                   warmup_iters=5, lr_decay_iters=60, eval_every=30, log_every=10)
    if args.steps:
        c.max_iters = c.lr_decay_iters = args.steps
    for item in args.set:
        key, _, value = item.partition("=")
        if not hasattr(c, key):
            raise SystemExit(f"baby_gpt: --set {item}: no Config field {key!r}; fields: {', '.join(vars(c))}")
        try:
            setattr(c, key, type(getattr(c, key))(value))
        except ValueError:
            raise SystemExit(f"baby_gpt: --set {item}: {key} takes a {type(getattr(c, key)).__name__}") from None
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    text = load_text(args.data or (None if args.quick else SHAKESPEARE), args.quick)
    chars = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(chars)}
    data = np.array([lookup[ch] for ch in text], dtype=np.uint16)
    n_val = int(len(data) * c.val_fraction)  # the same split as tk's recipe
    train, val = data[: len(data) - n_val], data[len(data) - n_val:]

    model = GPT(c, len(chars)).to(device)
    forward = model if args.no_compile or args.quick else torch.compile(model)
    optimizer = make_optimizer(model, c, device)
    pinned = device.type == "cuda"

    def batch() -> torch.Tensor:
        starts = torch.randint(len(train) - c.block_size, (c.batch_size,)).tolist()
        x = torch.from_numpy(np.stack([train[s: s + c.block_size + 1].astype(np.int64) for s in starts]))
        return (x.pin_memory() if pinned else x).to(device, non_blocking=True)

    curve: list[tuple[int, float]] = []
    loop_start = time.perf_counter()
    tokens = batch()
    for it in range(c.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, c)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        tokens = batch()  # the next batch is fetched while the GPU works, as nanoGPT does
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step = it + 1
        if step % c.log_every == 0:
            print(f"step {step:5d}  train loss {loss.item():.4f}  {time.perf_counter() - loop_start:7.1f} s", flush=True)
        if step % c.eval_every == 0 or step == c.max_iters:
            # eager, as tk's engine evaluates: the compiled forward would compile again for eval
            # mode and another batch size, time tk's run does not spend
            curve.append((step, val_loss(model, val, c, device)))
            print(f"step {step:5d}  val loss {curve[-1][1]:.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    loop_s, wall_s = time.perf_counter() - loop_start, time.perf_counter() - PROCESS_START

    params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nbaby GPT (nanoGPT-style bare loop), {params / 1e6:.2f} M parameters, {c.max_iters} updates of "
          f"{c.batch_size} x {c.block_size}, bf16{'' if forward is model else ', compiled'}, {name}")
    print(f"  val loss {curve[-1][1]:.4f}   training loop {loop_s:.1f} s   process {wall_s:.1f} s")
    print(json.dumps({"benchmark": "baby_gpt", "device": name, "torch": torch.__version__, "steps": c.max_iters,
                      "val_loss": round(curve[-1][1], 4), "curve": [[s, round(v, 4)] for s, v in curve],
                      "loop_s": round(loop_s, 1), "wall_s": round(wall_s, 1)}))


if __name__ == "__main__":
    main()
