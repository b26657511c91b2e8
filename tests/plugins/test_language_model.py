"""Tests for the language_model plugin: causality, tokenisers, metrics, training, generation, errors."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.nn.generation.decoding import GenerationConfig
from tk.core.recipe import load_config
from tk.core.step import StepOutput
from tk.core.text import TextTokenizer, build_tokenizer
from tk.plugins.language_model.cli import generate
from tk.plugins.language_model.corpus import synthetic_text
from tk.plugins.language_model.data import UNK, TokenizerConfig, decode, load_saved_tokenizer, train_documents
from tk.plugins.language_model.metrics import LMMetrics
from tk.plugins.language_model.task import TOKENIZER_FILE, TOKENS_FILE, LanguageModelTask

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


def char_tokenizer(text: str) -> TextTokenizer:
    """The char tokenizer a run trains (the task's tokenizer: section defaults)."""
    return TextTokenizer.train([text], TokenizerConfig(), [UNK])


def test_char_tokenizer_round_trips_and_maps_unknown_to_unk():
    text = "To be, or not to be: that is the question.\n"
    tok = char_tokenizer(text)
    assert decode(tok, tok.encode(text)) == text
    again = load_saved_tokenizer(tok.to_str())
    assert again.encode(text) == tok.encode(text)
    assert tok.encode("bé") == [tok.token_id("b"), 0]
    assert decode(tok, tok.encode("bé")) == "b" + UNK


def test_perplexity_is_exp_of_loss_and_bits_are_nats_over_ln2():
    metric = LMMetrics(per_char=True)
    metric.update(StepOutput(loss=torch.tensor(30.0), num_items=20), {})
    metric.update(StepOutput(loss=torch.tensor(12.0), num_items=10), {})
    out = metric.compute()
    assert out["perplexity"] == pytest.approx(math.exp(42.0 / 30))
    assert out["bits_per_token"] == pytest.approx(42.0 / 30 / math.log(2)) == out["bits_per_char"]


def test_tokens_are_saved_once_and_reloaded(tmp_path):
    task = make_task(tmp_path, ["tokenizer.kind=bpe", "tokenizer.vocab_size=300"])
    task.setup()
    tokens = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16)
    assert len(tokens) == len(task.splits["train"]) + len(task.splits["val"])
    text = synthetic_text(500, 0)
    assert task.tokenizer.decode(tokens.tolist()) == text
    again = make_task(tmp_path, ["tokenizer.kind=char"])  # the saved files win: no retraining
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


# ----------------------------------------------------------------------------- sampling, tokeniser, streaming


def test_block_sampling_is_a_pure_function_of_seed_rank_step_and_covers_the_corpus(tmp_path):
    from tk.core.data.loader import LoaderSpec

    task = make_task(tmp_path, ["data.block_size=16"])
    task.setup()

    def batches(seed, rank, n, world_size=1, batch_size=8):
        loader = task.build_loader("train", LoaderSpec(batch_size=batch_size, shuffle=True, seed=seed, rank=rank,
                                                       world_size=world_size))
        it = iter(loader)
        return [next(it)["tokens"] for _ in range(n)]

    a, b = batches(0, 0, 30), batches(0, 0, 30)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(batches(1, 0, 1)[0], a[0])
    # two processes with batches of 4 split one process's batches of 8 (the same updates)
    halves = [batches(0, rank, 3, world_size=2, batch_size=4) for rank in (0, 1)]
    assert all(torch.equal(torch.cat([h0, h1]), x) for h0, h1, x in zip(*halves, a))
    # every block is the corpus at its offset, and the offsets reach both ends of the train split
    train = torch.from_numpy(task.splits["train"].astype(np.int64))
    sampler = task.build_loader("train", LoaderSpec(batch_size=8, seed=0)).batch_sampler
    starts = [o for _, idx in zip(range(2000), sampler) for o in idx]
    n_starts = len(train) - 17 + 1
    assert min(starts) < 0.01 * n_starts
    assert max(starts) > 0.99 * n_starts - 1 and max(starts) <= n_starts - 1
    hist = np.bincount(np.array(starts) * 10 // n_starts, minlength=10)
    assert hist.min() > 0.7 * len(starts) / 10  # roughly uniform over the corpus
    first = batches(0, 0, 1)[0]
    it = iter(task.build_loader("train", LoaderSpec(batch_size=8, seed=0)).batch_sampler)
    for row, o in zip(first, next(it)):
        assert torch.equal(row, train[o: o + 16])


def test_char_tokenizer_round_trips_arbitrary_text():
    rng = np.random.default_rng(0)
    alphabet = list("abcXYZ 0123\n\t.,;:!?'\"") + ["é", "ß", "中", "🙂", "\u0301"]
    text = "".join(rng.choice(alphabet, size=2000))
    tok = char_tokenizer(text)
    other = "".join(rng.choice(alphabet, size=500))
    assert decode(tok, tok.encode(other)) == other
    assert decode(load_saved_tokenizer(tok.to_str()), tok.encode(other)) == other
    assert decode(tok, tok.encode("aΩb")) == "a" + UNK + "b"  # unseen characters map to <unk>


def test_text_stream_pieces_add_up_and_wait_for_whole_characters():
    from tk.core.text.stream import TextStream

    utf8 = "hé中".encode()  # byte "tokens": the decoder shows U+FFFD for an incomplete character
    pieces = []
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), pieces.append, eos_id=None)
    for i, b in enumerate(utf8):
        stream(i, torch.tensor([b]))
    stream.finish(utf8.decode())
    assert pieces == ["h", "é", "中"]


def test_continue_text_streams_every_token(tmp_path):
    task = make_task(tmp_path)
    task.setup()
    model = task.build_model().eval()
    pieces = []
    cfg = GenerationConfig(strategy="sample", max_len=12, seed=0)
    text = task.continue_text(model, "the cat", cfg, on_text=pieces.append)
    assert len(pieces) == 12 and "".join(pieces) == text == task.continue_text(model, "the cat", cfg)


def test_samples_are_written_at_each_evaluation(tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", f"output_dir={run}", "data.num_sentences=300",
                                      "data.eval_blocks=2", "model.dim=32", "model.depth=1", "train.max_steps=4",
                                      "train.eval_every=2", "data.num_samples=2", "data.sample_prompt_len=8", *FAST])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (run / "samples").iterdir())
    assert files == ["step_2.txt", "step_4.txt"]
    text = (run / "samples" / "step_4.txt").read_text()
    assert text.count("--- sample ") == 2
    # the same samples reach the run's loggers as text media
    assert (run / "media" / "val_samples_step_00000004.txt").read_text() == text


@pytest.mark.slow
def test_sigkill_and_resume_is_exact(tmp_path):
    """An iteration-based run killed with SIGKILL mid-run and resumed ends with the weights
    and per-step losses of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    small = ["data.num_sentences=300", "data.eval_blocks=2", "model.dim=32", "model.depth=1", "train.batch_size=4",
             "train.max_steps=120", "train.eval_every=40", "train.log_every=1", "data.num_samples=0",
             "train.num_workers=0", "train.progress=false"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert CliRunner().invoke(cli, ["run", "lm_synthetic", f"output_dir={reference}", *small]).exit_code == 0
    tk = str(Path(sys.executable).with_name("tk"))
    proc = subprocess.Popen([tk, "run", "lm_synthetic", f"output_dir={killed}", "train.save_every=1", *small],
                            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(killed.glob("checkpoints/step_000000[2-9]*.pt")):  # step 20 or later saved
        assert proc.poll() is None, f"the run ended before the test could kill it: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) < 120  # it really stopped mid-run
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", f"output_dir={killed}", "--resume", *small])
    assert result.exit_code == 0, result.output

    def train_losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}

    assert train_losses(killed) == train_losses(reference)
    ours, ref = load_file(killed / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


# ----------------------------------------------------------------------------- hub corpora (offline: save_to_disk)


@pytest.fixture
def saved_dataset(tmp_path):
    import datasets

    docs = synthetic_text(400, 1).split("\n")
    folder = tmp_path / "hub_ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})}
                         ).save_to_disk(str(folder))
    return folder, docs


def test_hub_dataset_with_a_text_column(tmp_path, saved_dataset):
    folder, docs = saved_dataset
    task = make_task(tmp_path, ["data.source=hf", f"data.hf_name={folder}", "data.hf_split=train"])
    task.setup()
    text = "".join(d + "\n\n" for d in docs if d)
    assert decode(task.tokenizer, np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16).tolist()) == text


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_hub_tokenizer_is_trained_on_the_streamed_train_part_only(tmp_path, kind):
    """A tokenizer trained here on a hub corpus sees the documents before the validation cut
    (streamed, never joined into one text): a character only in the last documents is
    unknown to it, and the token file still holds every document."""
    import datasets

    docs = [d for d in synthetic_text(400, 1).split("\n") if d]
    docs[-5:] = [d + " \u03a9" for d in docs[-5:]]  # Omega: only in the validation tenth
    folder = tmp_path / "hub_ds"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))
    task = make_task(tmp_path, ["data.source=hf", f"data.hf_name={folder}", f"tokenizer.kind={kind}",
                                "tokenizer.vocab_size=300", "data.val_fraction=0.1"])
    task.setup()
    tokens = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16).tolist()
    text = "".join(d + "\n\n" for d in docs)
    assert task.meta["num_chars"] == len(text)
    if kind == "char":
        assert task.tokenizer.tok.token_to_id("\u03a9") is None
        assert decode(task.tokenizer, tokens) == text.replace("\u03a9", "<unk>")
    else:  # byte-level BPE has every byte: the whole text round-trips
        assert task.tokenizer.vocab_size == 300 and task.tokenizer.decode(tokens) == text
    train_docs = list(train_documents(datasets.load_from_disk(str(folder)), task.data))
    assert "".join(train_docs) == text[: len(text) - int(len(text) * 0.1)]


def test_streamed_hub_dataset_gives_the_same_tokens(tmp_path, saved_dataset):
    folder, _ = saved_dataset
    runs = {}
    for streaming in ("false", "true"):
        task = make_task(tmp_path / streaming, ["data.source=hf", f"data.hf_name={folder}", f"data.streaming={streaming}"])
        task.setup()
        runs[streaming] = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16)
    assert np.array_equal(runs["false"], runs["true"])


def test_hub_dataset_with_a_given_tokenizer_is_tokenised_in_batches(tmp_path, saved_dataset):
    folder, docs = saved_dataset
    tok_file = tmp_path / "tokenizer.json"
    TextTokenizer.train([synthetic_text(300, 2)], TokenizerConfig(kind="bpe", vocab_size=300)).save(tok_file)
    task = make_task(tmp_path, ["data.source=hf", f"data.hf_name={folder}", f"tokenizer.path={tok_file}"])
    task.setup()
    tokens = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16)
    assert task.tokenizer.decode(tokens.tolist()) == "".join(d + "\n\n" for d in docs if d)
    assert task.meta["num_tokens"] == len(tokens) == len(task.splits["train"]) + len(task.splits["val"])


def test_hub_dataset_errors(tmp_path, saved_dataset):
    folder, _ = saved_dataset
    for override, message in ((["data.text_column=body"], "has no column 'body'"),
                              (["data.hf_split=validation"], "has no split 'validation'")):
        result = CliRunner().invoke(cli, ["run", "lm_synthetic", "data.source=hf", f"data.hf_name={folder}",
                                          *override, f"output_dir={tmp_path / 'run'}", *FAST])
        assert result.exit_code == 2 and message in result.output, result.output


def test_bits_per_byte_for_bpe(tmp_path):
    task = make_task(tmp_path, ["tokenizer.kind=bpe", "tokenizer.vocab_size=300", "data.eval_blocks=3"])
    task.setup()
    metric = task.build_metrics(None)["lm"]
    targets = task.splits["val"][1: 3 * 64 + 1].tolist()
    n_bytes = len(task.tokenizer.decode(targets).encode("utf-8"))
    metric.update(StepOutput(loss=torch.tensor(0.7 * len(targets)), num_items=len(targets)), {})
    out = metric.compute()
    assert out["bits_per_byte"] == pytest.approx(0.7 * len(targets) / math.log(2) / n_bytes)
    assert "bits_per_byte" not in make_task(tmp_path / "c").build_metrics(None)["lm"].keys()


# ----------------------------------------------------------------------------- one vocabulary (issue #23)


def old_char_ids(train_text: str, text: str) -> list[int]:
    """The ids of the char tokenizer before tk.core.text: <unk> 0, then the sorted characters."""
    index = {c: i + 1 for i, c in enumerate(sorted(set(train_text)))}
    return [index.get(c, 0) for c in text]


def test_char_run_tokens_equal_the_old_char_tokenizer(tmp_path):
    """A char run's token ids are those of the previous version (recipes' measured losses stay valid)."""
    task = make_task(tmp_path, ["data.val_fraction=0.3"])
    task.setup()
    corpus = synthetic_text(500, 0)
    train_text = corpus[: len(corpus) - int(len(corpus) * 0.3)]
    tokens = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16).tolist()
    assert tokens == old_char_ids(train_text, corpus)
    probe = corpus[:200] + "Zé"  # unseen characters map to <unk> (id 0)
    assert task.tokenizer.encode(probe) == old_char_ids(train_text, probe)
    assert task.vocab_size == len(set(train_text)) + 1


def test_a_run_with_the_old_char_tokenizer_file_is_read_with_the_same_ids(tmp_path):
    task = make_task(tmp_path)
    task.setup()
    chars = sorted(set(synthetic_text(500, 0)))
    task.files.write_text(TOKENIZER_FILE, json.dumps({"kind": "char", "unk": UNK, "chars": chars}))
    again = make_task(tmp_path)
    again.setup(resume=True)
    probe = "the cat sees Ω\n"
    assert again.tokenizer.encode(probe) == task.tokenizer.encode(probe) == old_char_ids("".join(chars), probe)
    assert decode(again.tokenizer, again.tokenizer.encode(probe)) == "the cat sees <unk>\n"


RENAMED = {"data.tokenizer=bpe": "tokenizer.kind", "data.bpe_vocab_size=300": "tokenizer.vocab_size",
           "data.tokenizer_file=gpt2": "tokenizer.path", "data.dataset=wikitext": "data.hf_name",
           "data.config=wikitext-2-raw-v1": "data.hf_config", "data.split=train": "data.hf_split",
           "data.synthetic_seed=1": "data.seed", "data.source=hub": "data.source=hf"}


@pytest.mark.parametrize("old", RENAMED)
def test_renamed_key_is_one_config_error_naming_the_new_key(tmp_path, old):
    result = CliRunner().invoke(cli, ["validate", "lm_synthetic", old, f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "renamed to" in lines[0], result.stderr
    key, _, value = RENAMED[old].partition("=")
    assert key in lines[0] and value in lines[0], result.stderr


@pytest.mark.parametrize("kind", ["wordpiece", "unigram", "bpe"])
def test_generated_text_joins_the_prompt_as_the_tokenizer_decodes_both(tmp_path, kind):
    """Decoding the continuation alone drops the space a WordPiece/Unigram decoder puts between
    words ("the cat" + "find" printed "the catfind"): the text after the prompt is what decoding
    prompt and continuation together adds, and the streamed pieces add up to it."""
    from tk.core.engine.inference import load_run

    run = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", f"output_dir={run}", *FAST, f"tokenizer.kind={kind}",
                                      "tokenizer.vocab_size=300", "data.num_sentences=300", "train.max_steps=3",
                                      "train.eval_every=3", "model.dim=32", "model.depth=1", "data.num_samples=0"])
    assert result.exit_code == 0, result.output
    task, model = load_run(run)
    cfg = GenerationConfig(strategy="greedy", max_len=12)
    pieces = []
    text = task.continue_text(model, "the cat sat", cfg, on_text=pieces.append)
    from tk.core.nn.generation import generate as generate_ids

    prompt_ids = task.tokenizer.encode("the cat sat")
    new_ids = generate_ids(model, torch.tensor([prompt_ids]), cfg).tokens[0].tolist()
    assert decode(task.tokenizer, prompt_ids) + text == decode(task.tokenizer, prompt_ids + new_ids)
    assert "".join(pieces) == text and "##" not in text


def test_a_prompt_with_unseen_characters_is_an_error_naming_them(tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", f"output_dir={run}", *FAST, "data.num_sentences=300",
                                      "train.max_steps=1", "train.eval_every=1", "model.dim=32", "model.depth=1",
                                      "data.num_samples=0"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(cli, ["generate", str(run), "--prompt", "the CAT ☃"])
    assert bad.exit_code == 2 and bad.stderr == (
        "error: the prompt has characters the model never saw ('ACT☃': they would all be <unk>); use the characters "
        "of its training text\n")
    assert CliRunner().invoke(cli, ["generate", str(run), "--prompt", "the cat"]).exit_code == 0


# ----------------------------------------------------------------------------- text files larger than memory


def _corpus_text() -> str:
    rng = np.random.default_rng(3)
    words = ["the", "cat", "Ünïcode", "naïve", "x1", "--", "ok.", "日本", "a\tb", "\n", "\n\n", "  ", "end"]
    return " ".join(rng.choice(words, size=3000)) + "\n"


@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece", "unigram"])
def test_text_files_are_read_in_chunks_with_the_whole_texts_tokenizer_and_tokens(tmp_path, monkeypatch, kind):
    """data.source=text reads its files in chunks and tokenises them piece by piece (a corpus
    larger than memory is never held): tokenizer and tokens equal those of the whole text,
    with chunks and pieces far smaller than the corpus and a word spanning two files."""
    from tk.core.text import long_text
    from tk.plugins.language_model import corpus

    text = _corpus_text()
    folder = tmp_path / "corpus"
    folder.mkdir()
    cut = text.index(" ", len(text) // 2) - 2  # inside a word: the files join there without a space
    (folder / "a.txt").write_bytes(text[:cut].replace("\n", "\r\n").encode())  # universal newlines, as read_text
    (folder / "b.txt").write_text(text[cut:], encoding="utf-8")
    monkeypatch.setattr(corpus, "_CHUNK", 97)
    monkeypatch.setattr(long_text, "_PIECE", 211)
    task = make_task(tmp_path, ["data.source=text", f"data.path={folder}", f"tokenizer.kind={kind}",
                                "tokenizer.vocab_size=300", "tokenizer.min_frequency=1", "data.val_fraction=0.1"])
    task.setup()
    whole = build_tokenizer(task.tok_cfg, [text[: len(text) - int(len(text) * 0.1)]])  # the whole-text path
    assert task.tokenizer.to_str() == whole.to_str()
    tokens = np.fromfile(task.files.path(TOKENS_FILE), dtype=np.uint16).tolist()
    assert tokens == whole.encode(text) and task.meta["num_chars"] == len(text)


def test_cut_pieces_cut_only_where_no_tokenizer_joins():
    from tk.core.text import cut_pieces

    text = _corpus_text()
    rng = np.random.default_rng(0)
    edges = np.sort(rng.choice(len(text), 40, replace=False))
    chunks = [text[a:b] for a, b in zip([0, *edges], [*edges, len(text)])]
    pieces = list(cut_pieces(chunks, piece=150))
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) >= 150 and p[-1] != " " and p[-1].strip() for p in pieces[:-1])
    assert all(p.startswith(" ") and p[1] != " " for p in pieces[1:])
    assert [len(p) for p in cut_pieces(chunks, piece=150, anywhere=True)][:-1] == [150] * (len(text) // 150)


def test_an_empty_text_corpus_is_an_error_and_leaves_no_token_file(tmp_path):
    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    result = CliRunner().invoke(cli, ["run", "lm_synthetic", "data.source=text", f"data.path={corpus}",
                                      f"output_dir={tmp_path / 'run'}", *FAST])
    assert result.exit_code == 2 and "is empty (0 tokens)" in result.output, result.output
    assert not list((tmp_path / "run").rglob("tokens.bin*"))
