"""Benchmark: a pretrained Hugging Face translator, tk vs transformers, in one run, interleaved.

A random ``MarianMTModel`` of opus-mt-en-de's shape (d_model 512, 6 encoder + 6 decoder layers, 8
heads, feed-forward 2048, vocab 58101, swish, scaled embeddings, sinusoidal positions, pad = decoder
start = 58100, eos 0, ``forced_eos_token_id`` 0, dropout 0.1, one shared embedding tied to the head,
a non-zero ``final_logits_bias``, noise on every 1-D parameter so that a wrong mapping would show;
opus-mt's generation config: ``bad_words_ids`` [[pad]]) saved locally with ``save_pretrained``
(float32). tk reads it with ``Translator(folder).build(...)`` (:mod:`tk.plugins.translation.pretrained`,
``load_seq2seq``) into its ``EncoderDecoder``; transformers with ``MarianMTModel.from_pretrained``.
In this process, float32, ``--threads`` threads:

1. Beam-4 translation, sentences per second, at batch 1 (``--b1`` sentences, one by one) and batch 32
   (``--b32`` sentences, 32 at a time) of random source ids (10-30 tokens ending in eos, right-padded;
   the same sentences for both): tk's ``generate(model, src, GenerationConfig(strategy="beam",
   beam_size=4, max_len=L, bos_id=pad, eos_id=0, pad_id=pad, forced_eos=True, beam_stop="heuristic"))``
   vs ``model.generate(input_ids, attention_mask, num_beams=4, max_length=L + 1)`` (transformers counts
   the decoder start), ``L = --new`` (32). Each library as it is called: tk's ``generate`` runs under
   ``inference_mode``, transformers' under ``no_grad``. The token ids must be the same (the share of
   equal rows is reported).
2. One training step (forward, label-smoothed (0.1) cross-entropy over the non-pad target tokens,
   backward, AdamW) at batch ``--batch`` (16) x ~24 tokens (source and target lengths 16-32): tk's
   model vs transformers' from the same folder, each in train mode (dropout 0.1, as opus-mt trains).
   The loss of the first batch with dropout off (eval mode) is the same to 1e-4.
3. Load: each measurement in a fresh subprocess (load + one forward of a 1 x 16 source and the decoder
   start, 1 thread): wall time, and peak RSS (``VmHWM``, reset after the imports through
   ``/proc/self/clear_refs``) above the RSS the imports left, as a multiple of the file's size.

A short warm-up first (a 4-token translation at each batch size, one training step, for each library);
then ``--reps`` repetitions, the libraries alternating batch by batch and which goes first; medians
of each repetition's seconds (and, as "best", the ratio of the fastest repetitions). The 1-minute load
average at the start and the end is printed: two threads on a 2-core machine shared with other work
slow down by several times in bursts, whichever library is running then. ``--quick``: a 64-wide
2 + 2 layer model with a 1000-token vocabulary, one repetition (the suite's smoke run).

Goals (from the issue on loading Hugging Face translators): beam-4 sentences/s >= 1.0x
transformers' ``generate`` at batch 1 and 32; training step >= 1.0x; load peak RSS reported.

    python benchmarks/pretrained_translation.py            # ~3-5 min on a 2-core CPU
    python benchmarks/pretrained_translation.py --threads 1  # steadier where the cores are shared
    python benchmarks/pretrained_translation.py --quick    # seconds

Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"full": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                       decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, vocab_size=58101),
          "quick": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000)}
EOS, SMOOTHING, LR = 0, 0.1, 1e-5

CHILD = r'''
import json, sys, time
from pathlib import Path
import torch
which, folder = sys.argv[1], Path(sys.argv[2])
if which == "tk":
    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.transformer import EncoderDecoder
    from tk.plugins.translation.pretrained import Translator
else:
    from transformers import MarianMTModel
torch.set_num_threads(1)


def status(key):  # kB
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])


import safetensors.torch  # noqa: F401  what each loader imports lazily, imported before the baseline
import transformers.models.marian.modeling_marian  # noqa: F401
import tk.core.exchange.hf.seq2seq  # noqa: F401
torch.nn.functional.linear(torch.randn(64, 64), torch.randn(64, 64))  # the thread pool's first allocations
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from what the imports left
base = status("VmRSS:")
t0 = time.perf_counter()
if which == "tk":
    translator = Translator(str(folder))
    cfg = TransformerConfig(**translator.fields)
    pad = int(translator.config["pad_token_id"])
    V = translator.vocab_size
    model = translator.build(lambda: EncoderDecoder(cfg, V, V, pad_id=pad), "float32").eval()
else:
    model = MarianMTModel.from_pretrained(folder, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
load_s = time.perf_counter() - t0
src, start = torch.arange(1, 17)[None], torch.full((1, 1), pad)
with torch.no_grad():
    out = model(src, start) if which == "tk" else model(input_ids=src, decoder_input_ids=start).logits
peak = status("VmHWM:")
print(json.dumps({"load_s": load_s, "extra_mb": (peak - base) / 1024}))
'''


# -- the model and the data ------------------------------------------------------------------
def save_model(folder: Path, quick: bool) -> dict:
    """The random opus-mt-shaped Marian, saved; its config."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    shape = SHAPES["quick" if quick else "full"]
    V = shape["vocab_size"]
    config = MarianConfig(**shape, decoder_vocab_size=V, pad_token_id=V - 1, decoder_start_token_id=V - 1,
                          eos_token_id=EOS, forced_eos_token_id=EOS, bos_token_id=EOS, activation_function="swish",
                          scale_embedding=True, max_position_embeddings=512, dropout=0.1, attention_dropout=0.0,
                          activation_dropout=0.0, share_encoder_decoder_embeddings=True)
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        model.final_logits_bias.copy_(0.3 * torch.randn_like(model.final_logits_bias))
    g = model.generation_config  # opus-mt-en-de's generation_config.json
    g.bad_words_ids, g.num_beams, g.max_length = [[V - 1]], 4, 512
    g.pad_token_id, g.eos_token_id, g.forced_eos_token_id, g.decoder_start_token_id = V - 1, EOS, EOS, V - 1
    model.save_pretrained(folder)
    return config.to_dict()


def sources(n: int, vocab: int, seed: int, lo: int = 10, hi: int = 30) -> list:
    """``n`` random source rows of ``lo``..``hi`` tokens, the last one eos (ids avoid eos and pad)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        n_tok = int(torch.randint(lo, hi + 1, (), generator=gen))
        rows.append(torch.cat([torch.randint(1, vocab - 1, (n_tok - 1,), generator=gen), torch.tensor([EOS])]))
    return rows


def pad_rows(rows: list, pad: int):
    import torch

    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)


def train_batch(batch: int, vocab: int, pad: int) -> dict:
    """Sources and targets of 16-32 tokens (~24): ``tgt_in`` starts with the decoder start (pad),
    ``tgt_out`` ends with eos; right-padded with pad."""
    import torch

    src = pad_rows(sources(batch, vocab, 100, 16, 32), pad)
    tgt = sources(batch, vocab, 101, 16, 32)
    tgt_in = pad_rows([torch.cat([torch.tensor([pad]), t[:-1]]) for t in tgt], pad)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": pad_rows(tgt, pad)}


# -- the two libraries -----------------------------------------------------------------------
def tk_model(folder: Path):
    import torch

    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.transformer import EncoderDecoder
    from tk.plugins.translation.pretrained import Translator

    translator = Translator(str(folder))
    cfg = TransformerConfig(**translator.fields)
    pad, V = int(translator.config["pad_token_id"]), translator.vocab_size
    model = translator.build(lambda: EncoderDecoder(cfg, V, V, pad_id=pad), "float32")
    assert next(model.parameters()).dtype == torch.float32
    return model


def hf_model(folder: Path):
    import torch
    from transformers import MarianMTModel

    return MarianMTModel.from_pretrained(folder, dtype=torch.float32)


def tk_loss(model, b: dict):
    from tk.core.losses import cross_entropy_sum

    total, count = cross_entropy_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], label_smoothing=SMOOTHING,
                                     ignore_index=model.pad_id)
    return total / count


def hf_loss(model, b: dict):
    import torch.nn.functional as F

    pad = model.config.pad_token_id
    logits = model(input_ids=b["src"], attention_mask=b["src"].ne(pad).long(), decoder_input_ids=b["tgt_in"]).logits
    return F.cross_entropy(logits.flatten(0, 1), b["tgt_out"].flatten(), ignore_index=pad, label_smoothing=SMOOTHING)


def tk_translate(model, src, new: int):
    from tk.core.nn.generation import GenerationConfig, generate

    pad = model.pad_id
    cfg = GenerationConfig(strategy="beam", beam_size=4, max_len=new, bos_id=pad, eos_id=EOS, pad_id=pad,
                           forced_eos=True, beam_stop="heuristic")
    return generate(model, src, cfg).tokens


def hf_translate(model, src, new: int):
    pad = model.config.pad_token_id
    out = model.generate(input_ids=src, attention_mask=src.ne(pad).long(), num_beams=4, max_length=new + 1,
                         do_sample=False)
    return out[:, 1:]  # without the decoder start


def same_rows(a, b, pad: int) -> list[bool]:
    import torch.nn.functional as F

    width = max(a.shape[1], b.shape[1])
    a, b = (F.pad(t, (0, width - t.shape[1]), value=pad) for t in (a, b))
    return a.eq(b).all(1).tolist()


# -- side by side ------------------------------------------------------------------------------
def compare(folder: Path, args: argparse.Namespace) -> dict:
    """Median seconds of tk and transformers: beam-4 translation at batch 1 and 32, a training step;
    the checks."""
    import torch

    torch.set_num_threads(args.threads)
    ours, theirs = tk_model(folder), hf_model(folder)
    pad, V = ours.pad_id, ours.src_embed.weight.shape[0]
    assert pad == theirs.config.pad_token_id
    reps = 1 if args.quick else args.reps
    times: dict[str, list[list[float]]] = {}
    counts: dict[str, int] = {}
    equal: list[bool] = []

    def timed(key: str, name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(key, [[], []])[name == "hf"].append(time.perf_counter() - t0)
        return out

    # 1. beam-4 translation
    ours.eval(), theirs.eval()
    cases = []
    for batch, n in ((1, args.b1), (32, args.b32)):
        rows = sources(n, V, seed=batch)
        key = f"beam-4 b{batch} ({n} sentences)"
        cases.append((key, [pad_rows(rows[i:i + batch], pad) for i in range(0, n, batch)]))
        counts[key] = n
    for model, translate in ((ours, tk_translate), (theirs, hf_translate)):  # warm-up: 4 tokens at each batch size
        for _, batches in cases:
            translate(model, batches[0], 4)
    for key, batches in cases:  # the libraries alternate batch by batch (a burst of load hits both)
        outs: dict[str, list] = {"tk": [None] * len(batches), "hf": [None] * len(batches)}
        for rep in range(reps):
            spent = {"tk": 0.0, "hf": 0.0}
            for i, src in enumerate(batches):
                for name in ("tk", "hf") if (rep + i) % 2 == 0 else ("hf", "tk"):
                    translate, model = (tk_translate, ours) if name == "tk" else (hf_translate, theirs)
                    t0 = time.perf_counter()
                    outs[name][i] = translate(model, src, args.new)
                    spent[name] += time.perf_counter() - t0
            for name, seconds in spent.items():
                times.setdefault(key, [[], []])[name == "hf"].append(seconds)
        equal += [e for a, b in zip(outs["tk"], outs["hf"]) for e in same_rows(a, b, pad)]
        generated = sum(int(t.ne(pad).sum()) for t in outs["tk"])
        counts[key + " mean out len"] = round(generated / counts[key], 1)

    # 2. a training step
    b = train_batch(args.batch, V, pad)
    with torch.no_grad():
        first = {"tk": tk_loss(ours, b).item(), "hf": hf_loss(theirs, b).item()}  # eval mode: dropout off
    ours.train(), theirs.train()
    opts = {"tk": torch.optim.AdamW(ours.parameters(), lr=LR), "hf": torch.optim.AdamW(theirs.parameters(), lr=LR)}

    def step(name: str) -> float:
        loss = (tk_loss(ours, b) if name == "tk" else hf_loss(theirs, b))
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return loss.item()

    tokens = int(b["tgt_out"].ne(pad).sum())
    key = f"train step b{args.batch} ({b['src'].shape[1]}/{b['tgt_in'].shape[1]} tok)"
    step("tk"), step("hf")  # warm-up (AdamW's state is made)
    for rep in range(reps):
        for name in ("tk", "hf") if rep % 2 == 0 else ("hf", "tk"):
            timed(key, name, lambda: step(name))
    med = {k: (statistics.median(v[0]), statistics.median(v[1]), min(v[0]), min(v[1])) for k, v in times.items()}
    return {"times": med, "counts": counts, "equal": equal, "first_loss": first, "train_tokens": tokens,
            "params": sum(p.numel() for p in ours.parameters())}


def measure(which: str, folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, which, str(folder)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the {which} load run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the report --------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, one repetition (the suite's smoke run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32, help="most new tokens per translation, eos included")
    ap.add_argument("--b1", type=int, default=4, help="sentences translated one by one")
    ap.add_argument("--b32", type=int, default=32, help="sentences translated 32 at a time")
    ap.add_argument("--batch", type=int, default=16, help="training batch (sentence pairs)")
    args = ap.parse_args()
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its bars would interleave with the table
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        config = save_model(folder, args.quick)
        size_mb = (folder / "model.safetensors").stat().st_size / 1e6
        speed = compare(folder, args)
        loads: dict[str, list[dict]] = {}
        for rep in range(1 if args.quick else args.reps):
            for which in ("tk", "transformers") if rep % 2 == 0 else ("transformers", "tk"):
                loads.setdefault(which, []).append(measure(which, folder))

    cpu, load = cpu_name(), [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"CPU: {cpu}; {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"load average {load[0]} at the start, {load[1]} at the end")
    print(f"model: random Marian, d_model {config['d_model']}, {config['encoder_layers']}+{config['decoder_layers']} "
          f"layers, {config['encoder_attention_heads']} heads, ffn {config['encoder_ffn_dim']}, vocab "
          f"{config['vocab_size']}, {speed['params'] / 1e6:.1f}M parameters, float32 file {size_mb:.1f} MB; "
          f"{speed['train_tokens']} target tokens in the training batch; medians of {1 if args.quick else args.reps}")
    result = {"benchmark": "pretrained_translation", "cpu": cpu, "threads": args.threads, "torch": torch.__version__,
              "transformers": transformers.__version__, "quick": args.quick, "loadavg": load,
              "file_mb": round(size_mb, 1)}
    print(f"\n{'float32, ' + str(args.threads) + ' threads':<34}{'tk':>10}{'transformers':>14}{'tk speed':>10}"
          f"{'best':>8}")
    for name, (ours, theirs, ours_best, theirs_best) in speed["times"].items():
        ratio, best = theirs / ours, theirs_best / ours_best
        if name.startswith("beam"):
            n = speed["counts"][name]
            print(f"{name + ', sent/s':<34}{n / ours:>10.2f}{n / theirs:>14.2f}{ratio:>9.2f}x{best:>7.2f}x")
            tag = name.split()[1]
            result[f"beam4_{tag}_tk_sent_per_s"] = round(n / ours, 3)
            result[f"beam4_{tag}_hf_sent_per_s"] = round(n / theirs, 3)
            result[f"beam4_{tag}_speed_x"] = round(ratio, 3)
            result[f"beam4_{tag}_speed_x_best"] = round(best, 3)
        else:
            print(f"{name + ', s':<34}{ours:>10.3f}{theirs:>14.3f}{ratio:>9.2f}x{best:>7.2f}x")
            result["train_tk_s"], result["train_hf_s"] = round(ours, 4), round(theirs, 4)
            result["train_step_speed_x"] = round(ratio, 3)
            result["train_step_speed_x_best"] = round(best, 3)
    print(f"\n{'load (fresh process, 1 thread)':<34}{'load s':>10}{'extra RSS MB':>14}{'x file':>10}")
    for which, runs in loads.items():
        load = statistics.median(r["load_s"] for r in runs)
        extra = statistics.median(r["extra_mb"] for r in runs)
        print(f"{which:<34}{load:>10.2f}{extra:>14.1f}{extra / size_mb:>10.2f}")
        key = "tk" if which == "tk" else "hf"
        result[f"{key}_load_s"] = round(load, 3)
        result[f"{key}_rss_x_file"] = round(extra / size_mb, 2)
    equal, first = speed["equal"], speed["first_loss"]
    lens = {k.split(" (")[0]: v for k, v in speed["counts"].items() if k.endswith("mean out len")}
    print(f"\nchecks: beam-4 token ids equal in {sum(equal)}/{len(equal)} sentences (tk's mean output length "
          + ", ".join(f"{k} {v}" for k, v in lens.items()) + f"); first loss tk {first['tk']:.6f} transformers "
          f"{first['hf']:.6f} (diff {abs(first['tk'] - first['hf']):.1e})")
    result.update({"same_ids": all(equal), "same_ids_fraction": round(sum(equal) / len(equal), 4),
                   "first_loss": round(first["tk"], 6), "first_loss_diff": abs(first["tk"] - first["hf"]),
                   "same_first_loss": abs(first["tk"] - first["hf"]) < 1e-4})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
