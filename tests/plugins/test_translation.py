"""Tests for the translation plugin: data and batching, masks, loss, decoding, tokenizer
task files, an end-to-end run scored with sacreBLEU, and ``tk translate``."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.nn.generation import generate
from tk.core.recipe import load_config
from tk.plugins.translation import TranslationTask
from tk.plugins.translation.data import read_pairs
from tk.plugins.translation.task import JOINT_FILE

TINY = ["data.source=reverse", "data.num_train=200", "data.num_val=20", "data.max_len=24", "data.max_tokens=256",
        "tokenizer.vocab_size=320", "model.dim=32", "model.depth=1", "model.num_heads=2", "model.max_len=64"]


def make_task(overrides=(), run_dir=None, resume=False) -> TranslationTask:
    cfg, task_cls = load_config("translation_reverse", list(TINY) + list(overrides))
    task = task_cls(cfg, run_dir)
    task.setup(resume=resume)
    return task


def test_collate_shifts_target_bos_and_eos():
    task = make_task()
    ds = task.build_dataset("train")
    batch = task.collate([ds[0], ds[1], ds[2]])
    bos, eos, pad = task.bos_id, task.eos_id, task.pad_id
    assert (bos, eos, pad) == (1, 2, 0)
    for row in range(3):
        tgt = ds[row]["tgt"]
        n = len(tgt) - 1
        assert batch["tgt_in"][row, 0] == bos and batch["tgt_out"][row, n - 1] == eos
        assert torch.equal(batch["tgt_in"][row, :n], tgt[:-1]) and torch.equal(batch["tgt_out"][row, :n], tgt[1:])
        assert batch["tgt_out"][row, n:].eq(pad).all()
        assert batch["src"][row, len(ds[row]["src"]) - 1] == eos


def test_pad_tokens_change_no_non_pad_output():
    torch.manual_seed(0)
    task = make_task()
    model = task.build_model().eval()
    ds = task.build_dataset("train")
    batch = task.collate([ds[i] for i in range(6)])
    src_pad, tgt_pad = batch["src"].eq(task.pad_id), batch["tgt_out"].eq(task.pad_id)
    assert src_pad.any() and tgt_pad.any()
    ref = model(batch["src"], batch["tgt_in"], src_key_padding_mask=src_pad)
    src2 = batch["src"].masked_fill(src_pad, 7)  # other tokens at the padded positions, same mask
    tgt2 = batch["tgt_in"].masked_fill(tgt_pad, 9)
    out = model(src2, tgt2, src_key_padding_mask=src_pad)
    keep = ~tgt_pad
    assert torch.allclose(ref[keep], out[keep], atol=1e-5)
    # and the task's loss (which derives the mask from PAD) equals a per-sentence computation
    total = task.loss(model, batch).loss
    single = sum(task.loss(model, task.collate([ds[i]])).loss for i in range(6))
    assert torch.allclose(total, single, rtol=1e-4)


def test_label_smoothed_loss_matches_hand_computation():
    task = make_task()
    torch.manual_seed(0)
    V, eps, pad = task.tgt_tok.vocab_size, 0.1, task.pad_id
    logits = torch.randn(2, 3, V)
    batch = {"src": torch.ones(2, 2, dtype=torch.long), "tgt_in": torch.ones(2, 3, dtype=torch.long),
             "tgt_out": torch.tensor([[5, 6, 2], [7, 2, pad]])}

    class Fixed(torch.nn.Module):
        def forward(self, src, tgt):
            return logits

    model = Fixed().train()
    out = task.loss(model, batch)
    logp = F.log_softmax(logits, -1)
    hand = 0.0
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        y = batch["tgt_out"][b, t]
        hand += (1 - eps) * -logp[b, t, y] + eps / V * -logp[b, t].sum()
    assert int(out.num_items) == 5
    assert math.isclose(float(out.loss), float(hand), rel_tol=1e-5)
    model.eval()  # evaluation: plain cross-entropy (perplexity = exp(loss / tokens))
    plain = sum(-logp[b, t, batch["tgt_out"][b, t]] for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)])
    assert math.isclose(float(task.loss(model, batch).loss), float(plain), rel_tol=1e-5)


def test_beam_size_one_equals_greedy():
    torch.manual_seed(0)
    task = make_task()
    model = task.build_model().eval()
    batch = task.collate([task.build_dataset("val")[i] for i in range(8)])
    greedy_cfg = task.generation_config(batch["src"].shape[1], beam_size=1)
    beam_cfg = task.generation_config(batch["src"].shape[1], beam_size=4)
    beam_cfg.beam_size, beam_cfg.length_penalty = 1, 0.0
    g, b = generate(model, batch["src"], greedy_cfg), generate(model, batch["src"], beam_cfg)
    assert greedy_cfg.strategy == "greedy" and beam_cfg.strategy == "beam"
    assert torch.equal(g.tokens, b.tokens)


def test_misaligned_files_name_both_files_and_counts(tmp_path):
    (tmp_path / "train.en").write_text("a\nb\nc\n")
    (tmp_path / "train.de").write_text("x\ny\n")
    files = ["data.source=files", f"data.train_prefix={tmp_path}/train", f"data.val_prefix={tmp_path}/nope"]
    cfg, _ = load_config("translation_reverse", TINY + files)
    with pytest.raises(TkError, match=r"train\.en has 3 lines but .*train\.de has 2"):
        read_pairs(cfg.sections["data"], "train")
    with pytest.raises(TkError, match="does not exist"):
        read_pairs(cfg.sections["data"], "val")


def test_empty_and_too_long_pairs_are_dropped_and_counted(tmp_path):
    (tmp_path / "train.en").write_text("a b\n\nc d\n" + " ".join(["w"] * 40) + "\n")
    (tmp_path / "train.de").write_text("x y\nz\n  \ny\n")
    task = make_task(["data.source=files", f"data.train_prefix={tmp_path}/train", f"data.val_prefix={tmp_path}/train",
                      "tokenizer.vocab_size=300", "tokenizer.min_frequency=1"])
    ds = task.build_dataset("train")
    assert len(ds) == 1 and ds.dropped == {"empty": 2, "too_long": 1} and ds.refs == ["x y"]


def test_tsv_and_jsonl_sources(tmp_path):
    (tmp_path / "d.tsv").write_text("hello\thallo\nworld\twelt\n")
    (tmp_path / "d.jsonl").write_text('{"en": "hello", "de": "hallo"}\n{"translation": {"en": "w", "de": "x"}}\n')
    cfg, _ = load_config("translation_reverse", TINY + ["data.source=tsv", f"data.train_prefix={tmp_path}/d.tsv"])
    assert read_pairs(cfg.sections["data"], "train") == [("hello", "hallo"), ("world", "welt")]
    cfg, _ = load_config("translation_reverse", TINY + ["data.source=jsonl", f"data.train_prefix={tmp_path}/d.jsonl"])
    assert read_pairs(cfg.sections["data"], "train") == [("hello", "hallo"), ("w", "x")]


def test_synthetic_pair_is_not_a_copy_or_reversal():
    cfg, _ = load_config("translation_synthetic", ["data.num_train=200"])
    pairs = read_pairs(cfg.sections["data"], "train")
    srcs, tgts = [s for s, _ in pairs], [t for _, t in pairs]
    assert sacrebleu.corpus_bleu(srcs, [tgts]).score < 5
    assert sacrebleu.corpus_bleu([" ".join(s.split()[::-1]) for s in srcs], [tgts]).score < 5
    assert read_pairs(cfg.sections["data"], "train") == pairs  # deterministic


@pytest.mark.slow
def test_end_to_end_run_learns_then_translate_from_stdin(tmp_path):
    run = tmp_path / "run"
    args = ["run", "translation_synthetic", f"output_dir={run}", "data.num_train=3000", "data.num_val=100",
            "data.max_tokens=1024", "model.dim=64", "train.max_steps=160", "train.eval_every=160",
            "train.progress=false",
            "schedule.warmup_steps=40", "optim.lr=3.0e-3", "train.keep_last=2", "train.save_every=80"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bleu = [r["val/bleu"] for r in evals if "val/bleu" in r][-1]
    task = make_task(["data.source=synthetic"], run_dir=run, resume=True)  # loads, never retrains
    assert not task.tokenizer_trained
    val = read_pairs(task.data, "val")
    copy_bleu = sacrebleu.corpus_bleu([s for s, _ in val], [[t for _, t in val]]).score
    assert bleu > copy_bleu + 30, (bleu, copy_bleu)
    # the saved tokenizer gives the ids the training run used
    cfg, _ = load_config(str(run / "config.yaml"))
    fresh = TranslationTask(cfg, None)
    fresh.setup(resume=False)  # retrained from the same data (no run dir): same ids as the saved file
    reloaded = TranslationTask(cfg, run)
    reloaded.setup(resume=True)
    text = [s for s, _ in val[:20]]
    assert reloaded.src_tok.encode_batch(text).ids == fresh.src_tok.encode_batch(text).ids
    before = (run / "artifacts" / JOINT_FILE).read_bytes()
    lines = "\n".join(s for s, _ in val[:5]) + "\n"
    out = CliRunner().invoke(cli, ["translate", str(run), "-", "--beam", "3", "--average-last", "2"], input=lines)
    assert out.exit_code == 0, out.output
    hyps = out.stdout.strip("\n").split("\n")
    assert len(hyps) == 5
    assert sacrebleu.corpus_bleu(hyps, [[t for _, t in val[:5]]]).score > copy_bleu + 20, hyps
    assert (run / "artifacts" / JOINT_FILE).read_bytes() == before
    # a line that is not UTF-8 (stdin or a binary file) is one error naming it, not a raw decode error
    bad = CliRunner().invoke(cli, ["translate", str(run), "-"], input=b"ein Haus\n\xff\xfe kaputt\n")
    assert bad.exit_code == 2 and bad.stderr == (
        "error: standard input line 2: not valid UTF-8 (invalid start byte); give UTF-8 text (re-encode it, e.g. "
        "iconv -f latin1 -t utf-8)\n")
    (tmp_path / "model.bin").write_bytes(bytes(range(256)))
    binary = CliRunner().invoke(cli, ["translate", str(run), str(tmp_path / "model.bin")])
    assert binary.exit_code == 2 and "model.bin line 2: not valid UTF-8" in binary.stderr  # line 1: bytes 0-10


# -- tokenizer variants -------------------------------------------------------------------
def test_given_tokenizer_json_is_used_not_retrained(tmp_path):
    from tk.core.text import TextTokenizer, TokenizerConfig

    texts = [s for pair in read_pairs(make_task().data, "train") for s in pair]
    given = TextTokenizer.train(texts, TokenizerConfig(vocab_size=265), ["<pad>", "<s>", "</s>", "<unk>"])
    given.save(tmp_path / "given.json")
    task = make_task([f"tokenizer.path={tmp_path}/given.json", "tokenizer.vocab_size=320"], run_dir=tmp_path / "run")
    assert not task.tokenizer_trained
    assert task.src_tok.vocab_size == given.vocab_size <= 265  # the file's vocabulary, not a new one of 320
    assert task.src_tok.encode_batch(texts[:10]).ids == given.encode_batch(texts[:10]).ids
    saved = (tmp_path / "run" / "artifacts" / JOINT_FILE).read_text()
    assert json.loads(saved)["model"] == json.loads(given.to_str())["model"]  # stored with the run
    (tmp_path / "bad.json").write_text(given.to_str().replace('"<unk>"', '"<oov>"'))
    with pytest.raises(TkError, match=r"lacks the special tokens \['<unk>'\]"):
        make_task([f"tokenizer.path={tmp_path}/bad.json"])
    with pytest.raises(TkError, match="tokenizer file not found"):
        make_task([f"tokenizer.path={tmp_path}/missing.json"])


def test_unigram_tokenizer_has_fixed_specials_and_round_trips():
    task = make_task(["tokenizer.kind=unigram"])
    vocab = task.src_tok
    assert type(vocab.tok.model).__name__ == "Unigram"
    assert [vocab.token_id(s) for s in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    texts = [s for s, _ in read_pairs(task.data, "val")[:10]]
    ids = vocab.encode_batch(texts, add_special_tokens=False).ids
    assert all(i >= 4 for seq in ids for i in seq)  # no specials inside plain text
    assert vocab.decode_batch(ids) == texts


def test_separate_vocabularies_two_task_files_and_model(tmp_path):
    (tmp_path / "train.en").write_text("the cat sees a dog\na dog sees the cat\nthe cat runs\n" * 4)
    (tmp_path / "train.de").write_text("die katze sieht einen hund\nein hund sieht die katze\ndie katze rennt\n" * 4)
    files = ["data.source=files", f"data.train_prefix={tmp_path}/train", f"data.val_prefix={tmp_path}/train",
             "tokenizer.min_frequency=1", "tokenizer.joint=false"]
    with pytest.raises(TkError, match="share_embeddings: needs one joint vocabulary"):
        make_task(files)
    run = tmp_path / "run"
    task = make_task(files + ["model.share_embeddings=false"], run_dir=run)
    assert (run / "artifacts" / "tokenizer.src.json").is_file() and (run / "artifacts" / "tokenizer.tgt.json").is_file()
    assert not (run / "artifacts" / JOINT_FILE).exists()
    src_tokens, tgt_tokens = set(task.src_tok.tok.get_vocab()), set(task.tgt_tok.tok.get_vocab())
    assert "Ġkatze" in tgt_tokens and "Ġkatze" not in src_tokens and "Ġcat" in src_tokens  # byte-level: Ġ = space
    model = task.build_model()
    assert model.src_embed is not model.tgt_embed
    assert model.src_embed.weight.shape[0] == task.src_tok.vocab_size
    assert model.lm_head.out_features == task.tgt_tok.vocab_size
    batch = task.collate([task.build_dataset("train")[i] for i in range(3)])
    assert torch.isfinite(task.loss(model, batch).loss)
    reloaded = make_task(files + ["model.share_embeddings=false"], run_dir=run, resume=True)
    assert not reloaded.tokenizer_trained
    assert reloaded.tgt_tok.encode("die katze") == task.tgt_tok.encode("die katze")


@pytest.mark.parametrize("old,new", [("data.lowercase=true", "tokenizer.lowercase"),
                                     ("data.hf_val_split=validation", "data.hf_split"),
                                     ("train.best_metric=val/ppl", "val/perplexity")])
def test_renamed_key_is_a_one_line_config_error(old, new, tmp_path):
    result = CliRunner().invoke(cli, ["validate", "translation_reverse", old, f"output_dir={tmp_path}/run"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "renamed to" in result.stderr and new in result.stderr, result.stderr


def test_hf_split_maps_tk_splits_to_dataset_splits(monkeypatch):
    calls = []

    def fake_load(name, config, split, **options):
        calls.append((name, config, split))
        return FakeDataset([{"translation": {"en": "a dog", "de": "ein Hund"}}])

    monkeypatch.setattr("tk.plugins.translation.data.load_hub_dataset", fake_load)
    cfg, _ = load_config("translation_reverse", TINY + ["data.source=hf", "data.hf_name=wmt14", "data.hf_config=de-en",
                                                         "data.hf_split={val: dev}"])
    assert read_pairs(cfg.sections["data"], "val") == [("a dog", "ein Hund")]
    read_pairs(cfg.sections["data"], "test")
    assert calls == [("wmt14", "de-en", "dev"), ("wmt14", "de-en", "test")]  # a key left out keeps its default
    with pytest.raises(TkError, match="keys must be among train, val, test"):
        load_config("translation_reverse", TINY + ["data.source=hf", "data.hf_name=x", "data.hf_split={dev: dev}"])


class FakeDataset(list):
    """What ``load_hub_dataset`` gives: rows, ``column_names`` and ``ds[column]``."""

    column_names = ("translation",)

    def __getitem__(self, key):
        return [row[key] for row in self] if isinstance(key, str) else super().__getitem__(key)


def test_periodic_beam_size_is_checked():
    with pytest.raises(TkError, match=r"decode\.periodic_beam_size \(0\) must be >= 1"):
        make_task(["decode.periodic_beam_size=0"])


# -- tk translate --checkpoint ----------------------------------------------------------------
def test_translate_checkpoint_option_uses_that_checkpoint(tmp_path):
    from tk.core.engine.inference import load_run

    run = tmp_path / "run"
    args = ["run", "translation_reverse", f"output_dir={run}", *TINY, "train.max_steps=2", "train.eval_every=1",
            "train.save_every=1", "train.keep_last=5", "train.progress=false", "optim.lr=0.05"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = [s for s, _ in read_pairs(make_task().data, "val")[:4]]
    step1 = run / "checkpoints" / "step_00000001.pt"
    for option, source in (("last", "last"), (str(step1), str(step1)), ("step_00000001.pt", str(step1))):
        out = CliRunner().invoke(cli, ["translate", str(run), "-", "--checkpoint", option, "--beam", "2"],
                                 input="\n".join(lines) + "\n")
        assert out.exit_code == 0, out.output
        task, model = load_run(run, source)
        assert out.stdout.split("\n")[:4] == task.translate(model, lines, beam_size=2), option
    bad = CliRunner().invoke(cli, ["translate", str(run), "-", "--checkpoint", "nope.pt"], input="a\n")
    assert bad.exit_code != 0 and "no such file" in bad.output


@pytest.mark.slow
def test_two_processes_with_token_budgets_finish(tmp_path):
    """torchrun, 2 gloo processes on CPU: each rank gets its share of the token-budget
    batches (the same number, or DDP would hang), rank 0 trains the tokenizer and writes
    the metrics, BLEU is computed over both ranks' hypotheses."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("tk")), "run", "translation_reverse", f"output_dir={run}",
         "--nproc-per-node", "2", *TINY, "data.max_tokens=128", "train.max_steps=4", "train.eval_every=2",
         "train.log_every=1", "train.progress=false", "train.device=cpu"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(2 processes)" in proc.stdout and proc.stdout.count("done: ") == 1
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "val/bleu" in r] == [2, 4]  # written once per evaluation
    assert json.loads((run / "artifacts" / "data_report.json").read_text())["val"]["kept"] == 20
    assert len((run / "eval" / "val_step4.hyp.txt").read_text().splitlines()) == 20  # both ranks' halves


def test_bleu_metric_logs_the_first_translations_as_text():
    """The first translations in dataset order (source, reference, hypothesis) go to the loggers."""
    from tk.core.media import Text
    from tk.core.step import EvalContext
    from tk.plugins.translation.metrics import CorpusBleu

    metric = CorpusBleu(refs=["ein Hund", "eine Katze", "ein Haus"], sources=["a dog", "a cat", "a house"])
    metric.hyps = [(2, "ein Haus"), (0, "ein Hund")]  # as merged from processes, not in order
    [item] = metric.media(EvalContext(split="val", step=7))
    assert isinstance(item, Text) and item.tag == "val/translations"
    assert item.text == "src: a dog\nref: ein Hund\nhyp: ein Hund\n\nsrc: a house\nref: ein Haus\nhyp: ein Haus\n"
