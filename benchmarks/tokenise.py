"""Benchmark: building the language model's token file (issue #36 item 3).

1. One corpus text (``data.source: text``): ``tokenizer.encode(text)`` on the whole string (what
   the language model did before; ``tokenizers`` runs one text on one core) against
   ``tk.core.text.encode_long`` (the text cut where no tokenizer kind joins across the cut, the
   pieces encoded as a batch on every core). Checks both give the same ids.
2. Documents in batches (``data.source: hf``, the token cache's build): ``encode_batch`` with one
   ``tokenizers`` thread against all of them (``RAYON_NUM_THREADS``, fixed per process, so each
   variant runs in its own process), and the time a 10B-token corpus (FineWeb's sample) would
   take at the measured rate on this machine.

Variants run interleaved (random order per repetition); medians over repetitions.

    python benchmarks/tokenise.py --quick     # smoke run on generated text (seconds)
    python benchmarks/tokenise.py             # Tiny Shakespeare x 8 from ../shared/data, byte-level BPE 8000

Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tk.core.text import TextTokenizer, TokenizerConfig, encode_long

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
FINEWEB_TOKENS = 10e9


def corpus(quick: bool, path: Path | None) -> str:
    if quick:
        from tk.plugins.language_model.corpus import synthetic_text

        return synthetic_text(20000, 0)
    path = path or SHAKESPEARE
    if not path.is_file():
        sys.exit(f"no corpus at {path}: pass --corpus FILE (or --quick)")
    return path.read_text(encoding="utf-8") * 8


def tokenizer(text: str, kind: str, vocab: int) -> TextTokenizer:
    return TextTokenizer.train([text[:2_000_000]], TokenizerConfig(kind=kind, vocab_size=vocab), ["<|endoftext|>"])


def documents_worker(args: argparse.Namespace) -> None:
    """One process: encode the corpus's documents in batches of 1000; print tokens/s."""
    text = corpus(args.quick, args.corpus)
    tok = tokenizer(text, args.kind, args.vocab)
    docs = [d + "\n\n" for d in text.split("\n\n") if d]
    if len(docs) < 1000:  # generated text: one sentence per line
        docs = [d + "\n" for d in text.split("\n") if d]
    start = time.perf_counter()
    n = sum(len(ids) for i in range(0, len(docs), 1000) for ids in tok.encode_batch(docs[i:i + 1000]).ids)
    print(json.dumps({"tokens": n, "seconds": time.perf_counter() - start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="generated text, 1 repetition")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--kind", default="bpe")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        documents_worker(args)
        return
    reps = 1 if args.quick else args.reps
    text = corpus(args.quick, args.corpus)
    tok = tokenizer(text, args.kind, args.vocab)
    same = encode_long(tok, text) == tok.encode(text)
    times: dict[str, list[float]] = {"whole string": [], "pieces": [], "docs, 1 thread": [], "docs, all threads": []}
    tokens = {}
    worker = [sys.executable, __file__, "--worker", "--kind", args.kind, "--vocab", str(args.vocab)]
    worker += ["--quick"] if args.quick else (["--corpus", str(args.corpus)] if args.corpus else [])
    for _ in range(reps):
        variants = list(times)
        random.shuffle(variants)
        for name in variants:
            if name.startswith("docs"):
                env = {**os.environ, "RAYON_NUM_THREADS": "1"} if "1 thread" in name else dict(os.environ)
                env.pop("RAYON_NUM_THREADS", None) if "all" in name else None
                out = json.loads(subprocess.run(worker, env=env, capture_output=True, text=True, check=True
                                                ).stdout.strip().splitlines()[-1])
                times[name].append(out["seconds"])
                tokens[name] = out["tokens"]
                continue
            start = time.perf_counter()
            ids = tok.encode(text) if name == "whole string" else encode_long(tok, text)
            times[name].append(time.perf_counter() - start)
            tokens[name] = len(ids)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    print(f"corpus: {len(text):,} characters; tokenizer {args.kind} {args.vocab}; {os.cpu_count()} cores ({cpu}); "
          f"median of {reps}")
    print(f"{'variant':<20} {'tokens':>12} {'seconds':>9} {'M tokens/s':>11}")
    for name in times:
        print(f"{name:<20} {tokens[name]:>12,} {med[name]:>9.3f} {tokens[name] / med[name] / 1e6:>11.2f}")
    rate = tokens["docs, all threads"] / med["docs, all threads"]
    result = {"benchmark": "tokenise", "same_ids": same, "pieces_speedup": round(med["whole string"] / med["pieces"], 2),
              "threads_speedup": round(med["docs, 1 thread"] / med["docs, all threads"], 2),
              "mtokens_per_s": round(rate / 1e6, 2), "cores": os.cpu_count(),
              "fineweb_10b_hours": round(FINEWEB_TOKENS / rate / 3600, 2)}
    print(f"encode_long = encode: {same}; pieces {result['pieces_speedup']}x the whole string; all threads "
          f"{result['threads_speedup']}x one; 10B tokens at {result['mtokens_per_s']} M tokens/s: "
          f"{result['fineweb_10b_hours']} h on this machine")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
