"""Tests for the language_model plugin: causality, tokenisers, metrics, training, generation, errors."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.recipe import load_config
from tk.core.step import StepOutput
from tk.plugins.language_model.cli import generate
from tk.plugins.language_model.corpus import synthetic_text
from tk.plugins.language_model.task import TOKENS_FILE, LanguageModelTask, LMMetrics
from tk.plugins.language_model.tokenizer import UNK, CharTokenizer, load_tokenizer_json

FAST = ["train.num_workers=0", "train.progress=false", "train.log_every=1000"]


def make_task(tmp_path, overrides=()) -> LanguageModelTask:
    cfg, task_cls = load_config("lm_synthetic", [f"output_dir={tmp_path / 'run'}", "data.num_sentences=500",
                                                 *overrides])
    return task_cls(cfg, tmp_path / "run")


def test_future_tokens_do_not_change_past_logits(tmp_path):
    task = make_task(tmp_path)
    task.setup()
    model = task.build_model().eval()
    tokens = torch.randint(0, task.vocab_size, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, task.vocab_size, (2, 8))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gpt2_init_scales_residual_projections(tmp_path):
    task = make_task(tmp_path, ["model.dim=256", "model.depth=8"])
    task.setup()
    params = dict(task.build_model().named_parameters())
    assert params["decoder.layers.0.self_attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    for name in ("decoder.layers.3.self_attn.proj.weight", "decoder.layers.3.mlp.fc2.weight"):
        assert params[name].std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_char_tokenizer_round_trips_and_maps_unknown_to_unk():
    text = "To be, or not to be: that is the question.\n"
    tok = CharTokenizer.train(text)
    assert tok.decode(tok.encode(text)) == text
    again = load_tokenizer_json(tok.to_json())
    assert again.encode(text) == tok.encode(text)
    assert tok.encode("bé") == [tok.index["b"], 0]
    assert tok.decode(tok.encode("bé")) == "b" + UNK


def test_perplexity_is_exp_of_loss_and_bits_are_nats_over_ln2():
    metric = LMMetrics(per_char=True)
    metric.update(StepOutput(loss=torch.tensor(30.0), num_items=20), {})
    metric.update(StepOutput(loss=torch.tensor(12.0), num_items=10), {})
    out = metric.compute()
    assert out["perplexity"] == pytest.approx(math.exp(42.0 / 30))
    assert out["bits_per_token"] == pytest.approx(42.0 / 30 / math.log(2)) == out["bits_per_char"]


def test_tokens_are_saved_once_and_reloaded(tmp_path):
    task = make_task(tmp_path, ["data.tokenizer=bpe", "data.bpe_vocab_size=300"])
    task.setup()
    tokens = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16)
    assert len(tokens) == len(task.splits["train"]) + len(task.splits["val"])
    text = synthetic_text(500, 0)
    assert task.tokenizer.decode(tokens.tolist()) == text
    again = make_task(tmp_path, ["data.tokenizer=char"])  # the saved files win: no retraining
    again.setup(resume=True)
    assert again.vocab_size == task.vocab_size and again.tokenizer.kind == "bpe"


def unigram_entropy_nats(text: str) -> float:
    counts = np.array(list(Counter(text).values()), dtype=np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lm") / "run"
    args = ["run", "lm_synthetic", f"output_dir={run}", "data.num_sentences=3000", "train.max_steps=150",
            "train.eval_every=150", "data.eval_blocks=40", *FAST]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return run


@pytest.mark.slow
def test_training_beats_the_unigram_entropy(trained_run):
    final = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in final if "val/loss" in r][-1]
    entropy = unigram_entropy_nats(synthetic_text(3000, 0))
    assert val["val/loss"] < 0.6 * entropy, (val, entropy)
    assert val["val/perplexity"] == pytest.approx(math.exp(val["val/loss"]), rel=1e-6)


@pytest.mark.slow
def test_generate_is_reproducible_and_cache_matches_recompute(trained_run):
    def run(*extra):
        result = CliRunner().invoke(generate, [str(trained_run), "--prompt", "the cat", "--max-new-tokens", "30",
                                               *extra])
        assert result.exit_code == 0, result.output
        return result.output

    sampled = run("generate.strategy=sample", "generate.seed=3", "generate.temperature=1.0")
    assert sampled == run("generate.strategy=sample", "generate.seed=3", "generate.temperature=1.0")
    assert sampled.startswith("the cat") and len(sampled.rstrip("\n")) == len("the cat") + 30
    greedy = run("generate.strategy=greedy")
    assert greedy == run("generate.strategy=greedy", "generate.use_cache=false")


@pytest.mark.slow
def test_generate_beyond_the_block_is_an_error(trained_run):
    result = CliRunner().invoke(generate, [str(trained_run), "--prompt", "the cat", "--max-new-tokens", "60"])
    assert result.exit_code != 0
    assert "exceeds data.block_size (64)" in str(result.exception) + result.output


def test_too_short_corpus_is_an_error_with_the_counts(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world, this is short\n")
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", "data.source=text", f"data.path={corpus}",
                                      f"output_dir={tmp_path / 'run'}", *FAST])
    assert result.exit_code == 2, result.output
    assert "has 25 tokens (corpus: 27" in result.output and "data.block_size + 1 = 65" in result.output


def test_missing_corpus_path_is_an_error(tmp_path):
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", "data.source=text", f"data.path={tmp_path}/nope*.txt",
                                      f"output_dir={tmp_path / 'run'}", *FAST])
    assert result.exit_code == 2 and "data.path: no text file" in result.output, result.output


def test_resume_continues_exactly(tmp_path):
    small = ["data.num_sentences=300", "data.eval_blocks=4", "model.dim=32", "model.depth=1", "train.batch_size=4",
             "train.eval_every=6", *FAST]

    def last_val(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["val/loss"] for r in rows if "val/loss" in r][-1]

    runner = CliRunner()
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert runner.invoke(cli, ["run", "lm_synthetic", f"output_dir={straight}", "train.max_steps=6", *small]).exit_code == 0
    assert runner.invoke(cli, ["run", "lm_synthetic", f"output_dir={halves}", "train.max_steps=3", *small]).exit_code == 0
    result = runner.invoke(cli, ["run", "lm_synthetic", f"output_dir={halves}", "train.max_steps=6", "--resume", *small])
    assert result.exit_code == 0, result.output
    assert last_val(halves) == pytest.approx(last_val(straight), rel=1e-6)
