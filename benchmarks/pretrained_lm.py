"""Benchmark: loading a Hugging Face decoder, tk vs transformers, in one run, interleaved.

A random Llama of SmolLM2-135M's shape (dim 576, 30 layers, 9 heads / 3 kv heads, hidden 1536, vocab
49152, tied) is saved locally in bf16; each measurement runs in a fresh subprocess (load + one forward
of 1 x 32 tokens) and reports wall time and peak RSS (``VmHWM``, reset after the imports through
``/proc/self/clear_refs``) above the RSS the imports left, as a multiple of the file's size. Two cases: the bf16 file kept in bf16, and upcast to float32. Medians of
``--reps`` alternating repetitions. ``--quick`` uses a 4-layer 128-wide model (the suite's smoke run).

Then, in this process, both models loaded from the same file in float32 (``--threads`` threads):
one training step (forward, backward, AdamW) at ``--seq`` tokens (batch 1), the same loss to 1e-5; and
cached greedy generation of ``--new`` tokens at batch 1 and 8 (``generate(do_sample=False)``), the same
tokens. Alternating repetitions, medians.

Goals (issue "The language model starts from the checkpoints people fine-tune"): peak RSS <= 1.2x the
file when its dtype is kept, <= 2.2x when bf16 is upcast to fp32; training step and generation >= 1.0x
transformers' speed.

    python benchmarks/pretrained_lm.py            # ~3 min on a 2-core CPU
    python benchmarks/pretrained_lm.py --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {"full": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152),
          "quick": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4096)}

CHILD = r'''
import json, sys, time
import torch
which, folder, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
if which == "tk":
    from tk.core.exchange.hf.decoders import decoder_config, load_decoder
    from tk.core.exchange.hf.folder import read_config
    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.lm import DecoderOnlyLM
else:
    from transformers import AutoModelForCausalLM
torch.set_num_threads(1)


def status(key):  # kB
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])


import safetensors.torch  # noqa: F401  what each loader imports lazily, imported before the baseline
import transformers.models.llama.modeling_llama  # noqa: F401
torch.nn.functional.linear(torch.randn(64, 64), torch.randn(64, 64))  # the thread pool's first allocations
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from what the imports left
base = status("VmRSS:")
t0 = time.perf_counter()
if which == "tk":
    config = read_config(__import__("pathlib").Path(folder))
    fields, vocab = decoder_config(config)
    cfg = TransformerConfig(**{**fields, "dropout": 0.0})
    model = load_decoder(lambda: DecoderOnlyLM(cfg, vocab), __import__("pathlib").Path(folder), dtype, config).eval()
else:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
load_s = time.perf_counter() - t0
with torch.no_grad():
    out = model(torch.zeros(1, 32, dtype=torch.long))
peak = status("VmHWM:")
print(json.dumps({"load_s": load_s, "extra_mb": (peak - base) / 1024}))
'''


def measure(which: str, folder: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, which, str(folder), dtype], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-only", action="store_true", help="only the load time / peak RSS table")
    args = ap.parse_args()
    if args.quick:
        args.seq, args.new = 64, 8
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        cfg = LlamaConfig(**SHAPES["quick" if args.quick else "full"], tie_word_embeddings=True,
                          max_position_embeddings=2048, rope_theta=100000.0)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
        size_mb = (folder / "model.safetensors").stat().st_size / 1e6
        rows = {}
        for rep in range(1 if args.quick else args.reps):
            for dtype in ("bfloat16", "float32"):
                for which in ("tk", "transformers") if rep % 2 == 0 else ("transformers", "tk"):
                    rows.setdefault((which, dtype), []).append(measure(which, folder, dtype))
        speed = {"times": {}, "checks": {}} if args.load_only else compare_speed(folder, args)
    print(f"CPU: {cpu_name()}; file {size_mb:.1f} MB (bf16)")
    print(f"{'loader':<14}{'weights':<10}{'load s':>8}{'extra RSS MB':>14}{'x file':>8}")
    result = {"benchmark": "pretrained_lm", "cpu": cpu_name(), "file_mb": round(size_mb, 1)}
    for (which, dtype), runs in rows.items():
        load = statistics.median(r["load_s"] for r in runs)
        extra = statistics.median(r["extra_mb"] for r in runs)
        print(f"{which:<14}{dtype:<10}{load:>8.2f}{extra:>14.1f}{extra / size_mb:>8.2f}")
        result[f"{which}_{dtype}_rss_x_file"] = round(extra / size_mb, 2)
        result[f"{which}_{dtype}_load_s"] = round(load, 3)
    print(f"\n{'float32, ' + str(args.threads) + ' threads':<26}{'tk':>10}{'transformers':>14}{'tk speed':>10}")
    for name, (ours, theirs) in speed["times"].items():
        print(f"{name:<26}{ours:>10.3f}{theirs:>14.3f}{theirs / ours:>9.2f}x")
        result[f"{name}_speed_x"] = round(theirs / ours, 3)
    result.update(speed["checks"])
    print(json.dumps(result))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compare_speed(folder: Path, args: argparse.Namespace) -> dict:
    """Median seconds of tk and transformers for a training step and cached greedy generation."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from tk.core.exchange.hf.decoders import decoder_config, load_decoder
    from tk.core.exchange.hf.folder import read_config
    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.generation import GenerationConfig, generate
    from tk.core.nn.lm import DecoderOnlyLM

    torch.set_num_threads(args.threads)
    config = read_config(folder)
    fields, vocab = decoder_config(config)
    cfg = TransformerConfig(**{**fields, "dropout": 0.0})
    ours = load_decoder(lambda: DecoderOnlyLM(cfg, vocab), folder, torch.float32, config)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.randint(0, vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def tk_step(opt):
        loss = torch.nn.functional.cross_entropy(ours(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def hf_step(opt):
        loss = torch.nn.functional.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times: dict[str, list[list[float]]] = {}
    losses = {}
    for name, model, step in (("tk", ours, tk_step), ("hf", theirs, hf_step)):
        model.train()
        losses[name] = step(torch.optim.SGD(model.parameters(), lr=0.0))  # same weights: the first loss
    opts = {"tk": torch.optim.AdamW(ours.parameters(), lr=1e-5), "hf": torch.optim.AdamW(theirs.parameters(), lr=1e-5)}
    reps = 1 if args.quick else args.reps
    for rep in range(reps + 1):  # the first pass warms up
        for name in ("tk", "hf") if rep % 2 == 0 else ("hf", "tk"):
            t0 = time.perf_counter()
            (tk_step if name == "tk" else hf_step)(opts[name])
            if rep:
                times.setdefault(f"train step seq {args.seq}", [[], []])[name == "hf"].append(time.perf_counter() - t0)
    ours.eval(), theirs.eval()
    same_tokens = True
    for batch in (1, 8):
        prompt = torch.randint(0, vocab, (batch, 16), generator=torch.Generator().manual_seed(batch))
        for rep in range(reps + 1):
            for name in ("tk", "hf") if rep % 2 == 0 else ("hf", "tk"):
                t0 = time.perf_counter()
                with torch.no_grad():
                    if name == "tk":
                        a = generate(ours, prompt, GenerationConfig(max_len=args.new)).tokens
                    else:
                        b = theirs.generate(prompt, do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new,
                                            eos_token_id=None, pad_token_id=0)[:, 16:]
                if rep:
                    times.setdefault(f"generate {args.new} x b{batch}", [[], []])[name == "hf"].append(
                        time.perf_counter() - t0)
        same_tokens &= bool(torch.equal(a, b))
    med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in times.items()}
    return {"times": med, "checks": {"first_loss_diff": abs(losses["tk"] - losses["hf"]), "same_tokens": same_tokens}}


if __name__ == "__main__":
    main()
