"""Smoke runs of the benchmark scripts: they must run and end with one JSON line.

Speed is not asserted here (targets live in the benchmarks, run alone); correctness
checks that the scripts make (e.g. cached == uncached == reference tokens) are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

CASES = {
    "attention": ["--quick", "--reps", "1", "--gen-reps", "1"],
    "generation": ["--quick", "--tokens", "8", "--reps", "1"],
    "engine_overhead": ["--quick", "--steps", "4", "--reps", "1"],
    "vit_cifar": ["--quick"],
    "lm": ["--quick", "--iters", "4"],
    "translation": ["--quick", "--reps", "1"],
    "tokenise": ["--quick"],
    "packing": ["--quick"],
    "image_pipeline": ["--quick", "--reps", "1"],
    "gpu": ["--quick"],
    "baby_gpt": ["--quick"],
    "vit_cifar_timm": ["--quick"],
    "pretrained_lm": ["--quick"],
    "sft": ["--quick"],
    "pretrained_translation": ["--quick"],
}


def run_benchmark(name: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *CASES[name]],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == name
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_and_ends_with_json(name: str) -> None:
    result = run_benchmark(name)
    if name == "generation":
        # tk cached, tk uncached, beam cached/uncached and the independent reference model
        # (same weights) all decode the same tokens
        assert result["tokens_equal"] is True
    if name == "lm":  # tk and the bare loop did the same updates (same batches, weights, schedule)
        assert result["same_updates"] is True
    if name == "tokenise":  # the text cut into pieces encodes to the same ids as the whole string
        assert result["same_ids"] is True
    if name == "packing":  # a packed batch gives the padded batch's loss
        assert result["same_loss"] is True
    if name == "gpu":  # every section ran; tk's generate and the minimal cached decoder agree
        assert {"vit", "lm", "translation", "generation", "data"} <= set(result)
        assert all(result["generation"][f"batch_{b}"]["same_tokens"] for b in (1, 16))
    if name == "baby_gpt":  # the reference loop learns: below a uniform guess over the characters, and falling
        curve = [loss for _, loss in result["curve"]]
        assert curve[-1] < curve[0] < 3.5
    if name == "vit_cifar_timm":  # the timm loop ran to its last evaluation
        assert result["updates"] == 8 and 0.0 <= result["top1"] <= 1.0
    if name == "pretrained_lm":  # tk and transformers: the same first loss and the same generated tokens
        assert result["same_tokens"] is True and result["first_loss_diff"] < 1e-5
    if name == "sft":  # tk, transformers + peft (and TRL): the same logits and first loss; packing without cross-talk
        assert result["same_first_loss"] is True and result["logits_diff"] < 1e-4
        assert result["packed_loss_diff"] < 1e-5 and result["packed_padding_share"] < result["padded_padding_share"]
        assert {"tk_padded", "tk_packed", "peft_padded"} <= set(result["peak_mb"])
    if name == "pretrained_translation":  # tk and transformers: the same beam-4 token ids and the same first loss
        assert result["same_ids"] is True and result["first_loss_diff"] < 1e-4
    if name == "translation":
        # beam-4 decoding with and without the KV cache gives the same tokens
        assert result["tokens_equal"] is True


def test_gpu_benchmark_keeps_the_other_sections_when_one_fails(tmp_path, monkeypatch, capsys) -> None:
    # A GPU is lent for minutes: a section that breaks (or a run cut off by its time limit) must not
    # cost the figures of the sections already measured.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu

    def broken(args, device):
        raise RuntimeError("CUDA out of memory (planted)")
    monkeypatch.setitem(gpu.BENCHES, "lm", broken)
    partial = tmp_path / "gpu.json"
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--quick", "--only", "lm,generation", "--partial", str(partial)])
    with pytest.raises(SystemExit, match="sections that failed: lm"):
        gpu.main()
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(partial.read_text())
    assert last["lm"]["error"] == "RuntimeError: CUDA out of memory (planted)"
    assert all(last["generation"][f"batch_{b}"]["same_tokens"] for b in (1, 16))
