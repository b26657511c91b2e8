"""The continuations a language-model run writes at each evaluation (``samples/step_N.txt``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.core.nn.generation import generate
from tk.core.step import EvalContext
from tk.plugins.language_model.data import decode

SAMPLES_DIR = "samples"  # in the run dir: step_N.txt, a few generated continuations per evaluation


def write_samples(task: Any, model: nn.Module, tokens: torch.Tensor, ctx: EvalContext) -> str:
    """``data.num_samples`` continuations of the first ``data.sample_prompt_len`` tokens of val
    blocks (``generate:`` settings), written to the run dir; returns their text."""
    d = task.data
    n = min(d.num_samples, tokens.shape[0])
    prompt_len = min(d.sample_prompt_len, d.block_size - 1)
    cfg = dataclasses.replace(task.gen_cfg, max_len=min(task.gen_cfg.max_len, d.block_size - prompt_len))
    out = generate(model, tokens[:n, :prompt_len], cfg)
    parts = []
    for i in range(n):
        prompt, generated = decode(task.tokenizer, tokens[i, :prompt_len]), decode(task.tokenizer, out.tokens[i])
        parts.append(f"--- sample {i}: prompt {prompt!r}\n{prompt}{generated}\n")
    suffix = "" if ctx.key_prefix == "val" else f"_{ctx.key_prefix}"
    path = Path(task.run_dir) / SAMPLES_DIR / f"step_{ctx.step}{suffix}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts), encoding="utf-8")
    return "".join(parts)
