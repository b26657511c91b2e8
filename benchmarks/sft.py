"""Benchmark: a LoRA fine-tuning step, tk vs transformers + peft (and TRL's SFTTrainer), in one run.

The same random Llama (SmolLM2-135M's layer shape: dim 576, 9 heads / 3 kv heads, hidden 1536,
vocab 49152, tied; 4 layers instead of 30 so a run fits a few CPU minutes), saved with
``save_pretrained``, in float32; the same LoRA on both (rank 16, alpha 32, dropout 0, on ``q_proj``
``k_proj`` ``v_proj`` ``o_proj``), tk's adapters randomised (B non-zero) and written into PEFT's model
through ``export_adapter`` (logits checked to 1e-4); the same examples: an Alpaca-like mix of prompt
and completion lengths (seeded lognormals, medians ~0.12 and ~0.23 of ``--max-len``: 30 and 60 tokens
at the default 256, the whole Alpaca shape halved to fit the CPU), random ids, targets on the
completion tokens only (-100 elsewhere, shifted as the sft task's ``make_example`` makes them).
The loss is cross-entropy summed over the targets / their number; the first batch's loss is the same
for every implementation (1e-4: the masking matches).

1. Step time at equal supervised tokens: right-padded batches of ``--batch`` examples, the same batches,
   one AdamW step each (lr 1e-4, no weight decay, no clipping): tk vs transformers + peft (the same
   loop written by hand, no attention mask: right padding under causal attention needs none) and
   TRL's ``SFTTrainer`` (``packing=False``, ``padding_free=False``, gradient checkpointing and bf16
   off, sequential sampler; the time from ``on_step_begin`` to ``on_step_end``, so its collation is
   not counted, as tk's and peft's batches are made beforehand; TRL feeds each example's last token
   too, one token more per example, and its collator adds an ``attention_mask``).
2. tk packed (``pack_examples`` into rows of ``--max-len``, block-causal ``segments``, about as many
   updates as padded) vs tk padded, over one pass of all the examples: real (non-pad) and supervised
   tokens per second, their ratio, the padding share of each.
3. Peak memory: each configuration's pass in a fresh subprocess (the four run side by side: a
   process's peak is its own), peak RSS (``VmHWM``, reset after the imports through
   ``/proc/self/clear_refs``) above the RSS the imports left: weights, adapters, AdamW state and
   activations.

``--threads`` threads; one warm-up step each, then ``--reps`` repetitions alternating the order of the
implementations; medians. Goal (issue #49 item 9): tk's step >= 1.0x transformers + peft's speed.

    python benchmarks/sft.py            # ~4 min on a 2-core CPU (TRL: pip install trl; without it, two columns)
    python benchmarks/sft.py --quick    # a 2-layer 64-wide model, 16 examples of <= 64 tokens (seconds)

Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"full": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152),
          "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA, LR, PAD = 16, 32.0, 1e-4, 0


# -- the examples ------------------------------------------------------------------------
def make_examples(n: int, max_len: int, vocab: int, seed: int = 0) -> list:
    """``n`` (inputs, targets) pairs: Alpaca-like prompt and completion lengths (lognormal, medians
    60 and 120 tokens per 512 of ``max_len``), random ids, only the completion supervised."""
    from tk.plugins.sft.data import Counts, make_example

    rng, counts, out = random.Random(seed), Counts(), []
    while len(out) < n:
        prompt = min(max_len // 2, max(1, round(rng.lognormvariate(math.log(60 * max_len / 512), 0.6))))
        answer = min(max_len + 1 - prompt, max(2, round(rng.lognormvariate(math.log(120 * max_len / 512), 0.8))))
        ids = [rng.randrange(2, vocab) for _ in range(prompt + answer)]  # 0 pads
        example = make_example(ids, [0] * prompt + [1] * answer, max_len, counts)
        if example is not None:
            out.append(example)
    return out


def make_batches(examples: list, batch: int, max_len: int) -> tuple[list, list]:
    """Padded batches of ``batch`` examples in order, and packed rows of ``max_len`` tokens grouped
    into as many batches (or fewer)."""
    from tk.plugins.sft.data import collate_examples, pack_examples

    padded = [collate_examples(examples[i:i + batch], PAD) for i in range(0, len(examples), batch)]
    rows = pack_examples(examples, max_len)
    per = math.ceil(len(rows) / len(padded))
    packed = [collate_examples(rows[i:i + per], PAD) for i in range(0, len(rows), per)]
    return padded, packed


def hf_rows(examples: list) -> list[dict]:
    """The examples as transformers takes them: the whole sequence in, ``labels`` unshifted (the
    model shifts them: position t is scored on ``labels[t + 1]``), -100 where nothing is learned."""
    return [{"input_ids": x + [y[-1]], "labels": [-100] + y} for x, y in examples]


# -- the models --------------------------------------------------------------------------
def save_model(folder: Path, quick: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES["quick" if quick else "full"], tie_word_embeddings=True, max_position_embeddings=2048,
                      rope_theta=100000.0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


def tk_model(folder: Path, randomise: bool = True):
    """tk's decoder from the folder with LoRA on the family's names (adapters randomised, B non-zero);
    the model and its PEFT-format adapter tensors."""
    import torch

    from tk.core.exchange.hf.decoders import family_of, load_decoder
    from tk.core.exchange.hf.peft import export_adapter, linear_names
    from tk.core.exchange.hf.source import HFSource
    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.lm import DecoderOnlyLM
    from tk.core.nn.lora import LoRAConfig, LoRALinear, apply_lora

    source = HFSource.open(str(folder))
    cfg = TransformerConfig(**{**source.fields, "dropout": 0.0})
    model = load_decoder(lambda: DecoderOnlyLM(cfg, source.vocab_size), folder, torch.float32)
    family = family_of(source.config)
    names = linear_names(family, model, cfg)
    apply_lora(model, RANK, ALPHA, 0.0, TARGETS, [], names=names)
    if randomise:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=gen) * 0.05)
                    m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.05)
    _, tensors = export_adapter(model, names, family, cfg, LoRAConfig(rank=RANK, alpha=ALPHA, targets=TARGETS),
                                str(folder))
    return model.train(), tensors


def peft_model(folder: Path, tensors: dict | None):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                      lora_dropout=0.0))
    if tensors is not None:
        result = peft.set_peft_model_state_dict(model, tensors)
        if result.unexpected_keys:
            raise RuntimeError(f"PEFT did not take tk's adapter tensors {result.unexpected_keys[:3]}")
    return model.train()


def tk_loss(model, batch):
    from tk.core.losses import cross_entropy_sum

    total, count = cross_entropy_sum(model(batch["tokens"], segments=batch.get("segments")), batch["targets"],
                                     ignore_index=-100)
    return total / count


def peft_loss(model, batch):
    import torch.nn.functional as F

    logits = model(input_ids=batch["tokens"]).logits  # (B, T, V): position t predicts targets[t]
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)


class Stepper:
    """One AdamW update per batch of a model and its loss function."""

    def __init__(self, model, loss_fn) -> None:
        import torch

        self.model, self.loss_fn = model, loss_fn
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)

    def step(self, batch) -> float:
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def run(self, batches) -> float:
        """Seconds for one update on each of ``batches``."""
        start = time.perf_counter()
        for batch in batches:
            self.step(batch)
        return time.perf_counter() - start


# -- TRL -----------------------------------------------------------------------------------
def trl_trainer(model, examples: list, batch: int, out: Path):
    """TRL's SFTTrainer on ``model`` (a PeftModel), the examples as ids + labels (HF's unshifted
    labels: the whole sequence in, the targets one place on), in order, ``batch`` per update."""
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows = hf_rows(examples)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1}, "</s>")),
                                        pad_token="<pad>", eos_token="</s>")  # ids come made; TRL reads pad/eos
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=batch, max_steps=math.ceil(len(rows) / batch),
                     learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                     optim="adamw_torch", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
                     packing=False, padding_free=False, max_length=None, train_sampling_strategy="sequential",
                     dataloader_num_workers=0, logging_strategy="no", save_strategy="no", report_to="none",
                     disable_tqdm=True, seed=0)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)

    clock = Clock()
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # its end-of-train line would interleave with the table
    return trainer, clock


def trl_run(trainer, clock, steps: int | None = None) -> float:
    """Seconds of the update steps of one ``trainer.train()`` (``steps``: fewer than a pass)."""
    full = trainer.args.max_steps
    trainer.args.max_steps = steps or full
    clock.seconds = []
    trainer.train()
    trainer.args.max_steps = full
    return sum(clock.seconds)


def has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


# -- side by side ------------------------------------------------------------------------------
def check(tk, ref, trainer, examples: list, padded: list, max_len: int) -> dict:
    """Same logits (tk vs peft); same first-batch loss from tk's targets and from the labels as
    transformers (``labels=``, its own shift) and TRL take them; and a packed batch's summed loss
    equal to its examples' padded (the packing has no cross-talk)."""
    import torch

    from tk.core.losses import cross_entropy_sum
    from tk.plugins.sft.data import collate_examples, pack_examples

    first, n = padded[0], len(padded[0]["tokens"])
    rows = hf_rows(examples[:n])
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (T - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (T - len(r["labels"])) for r in rows])
    with torch.no_grad():
        logits_diff = (tk(first["tokens"]) - ref(input_ids=first["tokens"]).logits).abs().max().item()
        losses = {"tk": tk_loss(tk, first).item(), "peft": ref(input_ids=ids, labels=labels).loss.item()}
        if trainer is not None:
            inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
            losses["trl"] = trainer.compute_loss(trainer.model, trainer._prepare_inputs(inputs)).item()
        packed_rows = pack_examples(examples, max_len)[:2]
        sums = [cross_entropy_sum(tk(b["tokens"], segments=b.get("segments")), b["targets"], ignore_index=-100)[0]
                for b in (collate_examples(packed_rows, PAD), collate_examples(sum(packed_rows, []), PAD))]
    diffs = {name: abs(loss - losses["tk"]) for name, loss in losses.items() if name != "tk"}
    return {"logits_diff": logits_diff, "first_loss": round(losses["tk"], 5),
            "first_loss_diff": max(diffs.values()), "first_loss_diffs": diffs,
            "packed_loss_diff": abs(sums[0].item() - sums[1].item()) / max(1.0, abs(sums[1].item()))}


def compare(folder: Path, examples: list, padded: list, packed: list, args: argparse.Namespace) -> tuple[dict, dict]:
    """Checks, then median seconds of one pass over the batches per implementation."""
    tk, tensors = tk_model(folder)
    ref = peft_model(folder, tensors)
    trainer = clock = None
    if has_trl():
        trainer, clock = trl_trainer(peft_model(folder, tensors), examples, args.batch, folder.parent / "trl")
    checks = check(tk, ref, trainer, examples, padded, args.max_len)
    if checks["logits_diff"] > 1e-4 or checks["first_loss_diff"] > 1e-4:
        raise RuntimeError(f"tk and the reference disagree: logits by {checks['logits_diff']:.2e}, first losses by "
                           f"{checks['first_loss_diffs']}")
    ours, theirs = Stepper(tk, tk_loss), Stepper(ref, peft_loss)
    passes = {"tk padded": lambda: ours.run(padded), "peft padded": lambda: theirs.run(padded),
              "tk packed": lambda: ours.run(packed)}
    if trainer is not None:
        passes["trl padded"] = lambda: trl_run(trainer, clock)
    ours.step(padded[0]), theirs.step(padded[0]), ours.step(packed[0])  # warm-up, one step each
    if trainer is not None:
        trl_run(trainer, clock, 1)
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for rep in range(args.reps):
        for name in list(passes) if rep % 2 == 0 else list(passes)[::-1]:
            seconds[name].append(passes[name]())
    return checks, {name: statistics.median(s) for name, s in seconds.items()}


# -- peak memory, each configuration in a process of its own --------------------------------------
def status(key: str) -> int:  # kB
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def child(args: argparse.Namespace) -> dict:
    """One pass of configuration ``args.child`` over the examples; the peak RSS above the imports."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  imported before the baseline
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401

    import tk.core.exchange.hf.peft  # noqa: F401
    import tk.core.nn.lm  # noqa: F401
    if args.child == "trl padded":
        import datasets  # noqa: F401
        import trl  # noqa: F401
    torch.set_num_threads(args.threads)
    torch.nn.functional.linear(torch.randn(64, 64), torch.randn(64, 64))  # the thread pool's first allocations
    folder = Path(args.folder)
    examples = make_examples(args.examples, args.max_len, SHAPES["quick" if args.quick else "full"]["vocab_size"])
    padded, packed = make_batches(examples, args.batch, args.max_len)
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from what the imports left
    base = status("VmRSS:")
    if args.child == "trl padded":
        trl_run(*trl_trainer(peft_model(folder, None), examples, args.batch, folder.parent / "trl-child"))
    elif args.child == "peft padded":
        Stepper(peft_model(folder, None), peft_loss).run(padded)
    else:
        Stepper(tk_model(folder, randomise=False)[0], tk_loss).run(packed if args.child == "tk packed" else padded)
    return {"extra_mb": (status("VmHWM:") - base) / 1024}


def measure(names: list[str], folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of each configuration, their processes run side by side (a process's peak is its own)."""
    flags = ["--quick"] * args.quick + ["--threads", str(args.threads), "--examples", str(args.examples),
                                        "--batch", str(args.batch), "--max-len", str(args.max_len)]
    procs = {name: subprocess.Popen([sys.executable, __file__, "--child", name, "--folder", str(folder), *flags],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"the {name} memory run failed:\n{stderr[-2000:]}")
        out[name] = json.loads(stdout.strip().splitlines()[-1])["extra_mb"]
    return out


# -- the report --------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    import peft
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    if has_trl():
        import trl

        out["trl"] = trl.__version__
    return out


def report(args, examples, padded, packed, checks, med, memory, weights_mb) -> dict:
    real = sum(len(x) for x, _ in examples)
    targets = sum(sum(t != -100 for t in y) for _, y in examples)
    share = {kind: 1 - real / sum(b["tokens"].numel() for b in batches)
             for kind, batches in (("padded", padded), ("packed", packed))}
    steps = {"padded": len(padded), "packed": len(packed)}
    print(f"CPU: {cpu_name()}; {args.threads} threads; " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    shape = SHAPES["quick" if args.quick else "full"]
    print(f"model: Llama dim {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
          f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, hidden {shape['intermediate_size']}, "
          f"vocab {shape['vocab_size']} "
          f"tied, float32 ({weights_mb:.1f} MB); LoRA r{RANK} "
          f"a{ALPHA:g} on {'/'.join(TARGETS)}; {len(examples)} examples, {real:,} tokens, {targets:,} supervised, "
          f"max_len {args.max_len}; medians of {args.reps}")
    names = {"tk padded": "tk", "peft padded": "transformers + peft", "trl padded": "TRL SFTTrainer"}
    print(f"\n{'LoRA step, ' + str(steps['padded']) + ' batches of ' + str(args.batch):<28}{'s/step':>8}"
          f"{'sup tok/s':>11}{'tk speed':>10}")
    result = {"benchmark": "sft", "cpu": cpu_name(), **versions(), "threads": args.threads}
    for key, label in names.items():
        if key in med:
            x = med[key] / med["tk padded"]
            print(f"{label:<28}{med[key] / steps['padded']:>8.3f}{targets / med[key]:>11,.0f}{x:>9.2f}x")
            result[f"{key.split()[0]}_step_s"] = round(med[key] / steps["padded"], 4)
            if key != "tk padded":
                result[f"tk_vs_{key.split()[0]}_speed_x"] = round(x, 3)
    print(f"\n{'tk, one pass':<28}{'updates':>8}{'s':>8}{'real tok/s':>12}{'sup tok/s':>11}{'padding':>9}")
    for kind in ("padded", "packed"):
        s = med[f"tk {kind}"]
        print(f"{kind:<28}{steps[kind]:>8}{s:>8.2f}{real / s:>12,.0f}{targets / s:>11,.0f}{share[kind]:>9.1%}")
        result[f"{kind}_real_tokens_per_s"] = round(real / s)
        result[f"{kind}_padding_share"] = round(share[kind], 3)
    result["packed_vs_padded_x"] = round(med["tk padded"] / med["tk packed"], 3)
    print(f"packed / padded: {result['packed_vs_padded_x']:.2f}x")
    print(f"\npeak RSS above the imports, one pass in a fresh process (MB; weights {weights_mb:.1f}):")
    for key, mb in memory.items():
        print(f"  {key:<26}{mb:>8.0f}")
    result["peak_mb"] = {key.replace(" ", "_"): round(mb) for key, mb in memory.items()}
    print(f"\nchecks: logits diff {checks['logits_diff']:.1e}; first loss {checks['first_loss']} "
          f"(diff {', '.join(f'{k} {v:.1e}' for k, v in checks['first_loss_diffs'].items())}); "
          f"packed vs alone {checks['packed_loss_diff']:.1e}")
    result.update({k: checks[k] for k in ("logits_diff", "first_loss", "first_loss_diff", "packed_loss_diff")})
    result["same_first_loss"] = checks["first_loss_diff"] < 1e-4
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 16 short examples, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; --quick 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--examples", type=int, default=None, help="examples in a pass (default 24; --quick 16)")
    ap.add_argument("--batch", type=int, default=8, help="examples per padded batch")
    ap.add_argument("--max-len", type=int, default=None, help="tokens per example and packed row (256; --quick 64)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.reps = args.reps or (2 if args.quick else 5)
    args.examples = args.examples or (16 if args.quick else 24)
    args.max_len = args.max_len or (64 if args.quick else 256)
    if args.child:
        print(json.dumps(child(args)))
        return
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        save_model(folder, args.quick)
        weights_mb = (folder / "model.safetensors").stat().st_size / 2**20
        examples = make_examples(args.examples, args.max_len, SHAPES["quick" if args.quick else "full"]["vocab_size"])
        padded, packed = make_batches(examples, args.batch, args.max_len)
        checks, med = compare(folder, examples, padded, packed, args)
        configs = ["tk padded", "tk packed", "peft padded"] + ["trl padded"] * has_trl()
        memory = {} if args.no_memory else measure(configs, folder, args)
    print(json.dumps(report(args, examples, padded, packed, checks, med, memory, weights_mb)))


if __name__ == "__main__":
    main()
