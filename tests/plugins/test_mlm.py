"""Tests for the mlm plugin: BERT masking statistics, logits gathered at masked positions with
a tied decoder, the loss against a hand cross-entropy, learning, exact resume, predict, errors."""

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.recipe import load_config
from tk.core.text import TextTokenizer
from tk.plugins.mlm.data import IGNORE, mask_tokens
from tk.plugins.mlm.task import ENCODER_FILE, TOKENIZER_FILE

FAST = ["train.num_workers=0", "train.progress=false", "data.num_sentences=600", "model.dim=32", "model.depth=1",
        "tokenizer.vocab_size=100"]


def make_task(tmp_path, overrides=()):
    cfg, task_cls = load_config("mlm_synthetic", [f"output_dir={tmp_path / 'run'}", *FAST, *overrides])
    task = task_cls(cfg, tmp_path / "run")
    task.setup()
    return task


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# ----------------------------------------------------------------------------- masking


def test_masking_statistics_and_specials_are_never_chosen():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 105, (1000, 64), generator=g)
    ids[:, 0], ids[:, 50], ids[:500, 51:] = 2, 3, 0  # [CLS], [SEP], [PAD]
    special = ids < 5
    candidates = torch.arange(5, 105)
    inputs, labels = mask_tokens(ids, special, 4, candidates, 0.15, g)
    chosen = labels.ne(IGNORE)
    assert not (chosen & special).any() and torch.equal(inputs[special], ids[special])
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    n = int(chosen.sum())
    assert n / int((~special).sum()) == pytest.approx(0.15, abs=0.005)
    to_mask = inputs[chosen].eq(4).sum() / n
    kept = inputs[chosen].eq(ids[chosen]).sum() / n  # 10% kept + 1% of the random draws hit the original
    swapped = (inputs[chosen].ne(4) & inputs[chosen].ne(ids[chosen])).sum() / n
    assert float(to_mask) == pytest.approx(0.8, abs=0.01)
    assert float(kept) == pytest.approx(0.1 + 0.1 / 100, abs=0.01)
    assert float(swapped) == pytest.approx(0.1 - 0.1 / 100, abs=0.01)
    assert inputs[chosen].ge(4).all()  # a random replacement is never a special ([PAD] would become padding)


def test_collate_masks_no_special_and_val_masks_are_fixed(tmp_path):
    task = make_task(tmp_path)
    train = task.build_dataset("train")
    torch.manual_seed(0)
    batch = task.collate([train[i] for i in range(len(train))])
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(train[i]["input_ids"]) for i in range(len(train))],
                                          batch_first=True, padding_value=task.pad_id)
    chosen = batch["labels"].ne(IGNORE)
    assert not torch.isin(ids[chosen], task._special).any()
    assert torch.equal(batch["labels"][chosen], ids[chosen])
    assert ids[:, 0].eq(task.tokenizer.token_id("[CLS]")).all()
    val_a, val_b = task.build_dataset("val"), task.build_dataset("val")
    assert [x["labels"] for x in val_a.items] == [x["labels"] for x in val_b.items]  # same masks every evaluation
    assert any(y != IGNORE for x in val_a.items for y in x["labels"])


# ----------------------------------------------------------------------------- model and loss


def test_logits_only_at_masked_positions_and_decoder_is_tied(tmp_path):
    task = make_task(tmp_path)
    model = task.build_model().eval()
    assert model.head.decoder.weight is model.encoder.tok_embed.weight
    assert model.head.decoder.weight.data_ptr() == model.encoder.tok_embed.weight.data_ptr()
    torch.manual_seed(1)
    ds = task.build_dataset("train")
    batch = task.collate([ds[i] for i in range(8)])
    positions = batch["labels"].ne(IGNORE)
    logits = model(batch["input_ids"], None, positions)
    assert logits.shape == (int(positions.sum()), task.tokenizer.vocab_size)
    full = model(batch["input_ids"])  # (B, T, V)
    torch.testing.assert_close(logits, full[positions], atol=1e-5, rtol=1e-5)


def test_loss_is_the_summed_cross_entropy_of_the_masked_tokens(tmp_path):
    task = make_task(tmp_path)
    model = task.build_model().eval()
    ids = torch.tensor([[2, 10, 11, 12, 3], [2, 13, 14, 3, 0]])
    inputs = ids.clone()
    inputs[0, 2], inputs[1, 1] = 4, 4
    labels = torch.full_like(ids, IGNORE)
    labels[0, 2], labels[1, 1], labels[1, 2] = 11, 13, 14  # the last one: chosen but kept
    out = task.loss(model, {"input_ids": inputs, "labels": labels})
    log_p = F.log_softmax(model(inputs), -1)
    hand = -(log_p[0, 2, 11] + log_p[1, 1, 13] + log_p[1, 2, 14])
    assert int(out.num_items) == 3
    torch.testing.assert_close(out.loss, hand, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- runs


WORDS = [f"w{i}" for i in range(20)]


def counting_corpus(path, n=800, seed=0):
    """Lines of consecutive words (w3 w4 w5 ...), cycling mod 20: a masked word follows from its neighbours."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        start, length = torch.randint(20, (1,), generator=g).item(), torch.randint(6, 12, (1,), generator=g).item()
        lines.append(" ".join(WORDS[(start + k) % 20] for k in range(length)))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    corpus = counting_corpus(root / "count.txt")
    result = run_cli("run", "mlm_synthetic", f"output_dir={root / 'run'}", *FAST, "data.source=text",
                     f"data.path={corpus}", "data.max_len=16",
                     "model.pos_encoding=rotary", "train.max_steps=250",
                     "train.eval_every=250", "train.log_every=10", "schedule.warmup_steps=10", "optim.lr=3e-3")
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.mark.slow  # the shared 250-step run: ~30 s on a loaded 2-core CPU
def test_short_run_learns_and_writes_the_files_text_classification_reads(trained_run):
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if r["split"] == "train"]
    val = [r for r in rows if "val/top1" in r][-1]
    assert train[-1] < 0.7 * train[0]
    assert val["val/top1"] > 0.5  # chance: 1 / 20 words (1 / vocab_size for a guess over the vocabulary)
    assert val["val/top5"] > val["val/top1"]
    assert val["val/perplexity"] == pytest.approx(2.718281828 ** val["val/loss"], rel=1e-4)
    tok = TextTokenizer.from_str((trained_run / "artifacts" / TOKENIZER_FILE).read_text())
    spec = json.loads((trained_run / "artifacts" / ENCODER_FILE).read_text())
    assert spec["vocab_size"] == tok.vocab_size and spec["cfg"]["dim"] == 32 and spec["cfg"]["max_len"] == 16
    weights = load_file(trained_run / "model.safetensors")
    assert "encoder.tok_embed.weight" in weights and "head.dense.weight" in weights


@pytest.mark.slow
def test_predict_fills_each_mask(trained_run):
    task, model = load_run(trained_run, overrides=["predict.top_k=3"])
    good, bad = task.predict(model, ["w3 w4 [MASK] w6 w7 [MASK] w9", "no mask here"])
    assert len(good["masks"]) == 2 and all(len(m["tokens"]) == 3 for m in good["masks"])
    words = good["filled"].split()
    assert words[:2] + words[3:5] + words[6:] == ["w3", "w4", "w6", "w7", "w9"]
    assert [words[2], words[5]] == [m["tokens"][0] for m in good["masks"]]  # each [MASK] -> its top token
    assert good["masks"][0]["probs"] == sorted(good["masks"][0]["probs"], reverse=True)
    assert "[MASK]" in bad["error"]
    result = run_cli("predict", trained_run, "w1 [MASK] w3")
    assert result.exit_code == 0 and "filled" in result.output, result.output


def test_resume_is_exact(tmp_path):
    small = [*FAST, "data.num_sentences=300", "train.batch_size=8", "train.eval_every=3", "train.log_every=1"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert run_cli("run", "mlm_synthetic", f"output_dir={straight}", "train.max_steps=6", *small).exit_code == 0
    # the same vocabulary for both runs: the wordpiece trainer breaks count ties differently from run to run
    small.append(f"tokenizer.path={straight / 'artifacts' / TOKENIZER_FILE}")
    assert run_cli("run", "mlm_synthetic", f"output_dir={halves}", "train.max_steps=3", *small).exit_code == 0
    result = run_cli("run", "mlm_synthetic", f"output_dir={halves}", "train.max_steps=6", "--resume", *small)
    assert result.exit_code == 0, result.output

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]

    assert losses(halves) == losses(straight)
    ours, ref = load_file(halves / "model.safetensors"), load_file(straight / "model.safetensors")
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_one_line_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    result = run_cli("run", "mlm_synthetic", f"output_dir={tmp_path / 'a'}", "data.source=text", f"data.path={empty}",
                     *FAST)
    assert result.exit_code == 2 and "has 0 non-empty text(s)" in result.output, result.output
    result = run_cli("run", "mlm_synthetic", f"output_dir={tmp_path / 'b'}", *FAST, "tokenizer.vocab_size=8")
    assert result.exit_code == 2 and "tokenizer.vocab_size (8) must be >= 16" in result.output, result.output
    result = run_cli("run", "mlm_synthetic", f"output_dir={tmp_path / 'c'}", "data.source=text",
                     f"data.path={tmp_path / 'missing'}", *FAST)
    assert result.exit_code == 2 and "data.path: no text file" in result.output, result.output


# ----------------------------------------------------------------------------- sources and reuse


def test_hf_corpus_is_read_from_its_text_column(tmp_path):
    import datasets

    docs = ["the cat sat on the mat", "", "a dog ran in the park", "the bird sang"] * 20
    folder = tmp_path / "hub_ds"
    datasets.Dataset.from_dict({"body": docs, "id": list(range(len(docs)))}).save_to_disk(str(folder))
    task = make_task(tmp_path, ["data.source=hf", f"data.hf_name={folder}", "data.text_column=body",
                                "data.val_fraction=0.1", "tokenizer.vocab_size=60"])
    assert task.texts["train"][:3] == ["the cat sat on the mat", "a dog ran in the park", "the bird sang"]
    assert len(task.texts["val"]) == 6  # 60 non-empty texts, the last 10%
    train = task.build_dataset("train")  # from the token cache
    seqs = [train[i] for i in range(len(train))]
    n = task.data.max_len
    assert all(len(s["input_ids"]) <= n for s in seqs) and len(seqs[0]["input_ids"]) == n  # packed: full sequences


def test_text_classification_reuses_the_mlm_tokenizer(tmp_path):
    mlm = make_task(tmp_path)
    cfg, task_cls = load_config("textcls_synthetic", [f"output_dir={tmp_path / 'cls'}", "data.num_train=50",
                                                      "data.num_val=10",
                                                      f"tokenizer.path={tmp_path / 'run' / 'artifacts' / TOKENIZER_FILE}"])
    cls = task_cls(cfg, tmp_path / "cls")
    cls.setup()
    text = "the movie was not bad"
    assert cls.encode([text], None).ids[0] == mlm.tokenizer.encode(text)  # [CLS] ... [SEP], the same ids


def test_filled_keeps_the_users_text_outside_the_masks():
    """Issue #35 item 2: case, unknown words and spacing stay as written; a ## piece joins."""
    from tk.plugins.mlm.fill import fill_text

    assert fill_text("The Zyxq  [MASK] sat, [MASK]!", ["cat", "##s"]) == "The Zyxq  cat sat, s!"
    assert fill_text("[MASK]", ["Hello"]) == "Hello"
    assert fill_text("no mask", ["x"]) is None  # not one [MASK] per token: the caller decodes instead


@pytest.mark.slow
def test_predict_keeps_case_and_unknown_words(trained_run):
    task, model = load_run(trained_run)
    out = task.predict(model, ["W3 qqqq-unknown [MASK] w6"])[0]
    assert out["filled"] == f"W3 qqqq-unknown {out['masks'][0]['tokens'][0].removeprefix('##')} w6"


@pytest.mark.slow
def test_the_train_tokens_come_from_the_token_cache_and_train_as_without_it(tmp_path, monkeypatch):
    """data.token_cache (issue #36 item 3): the packed train sequences cut from the cached token
    file are make_sequences' own, the losses equal a run without the cache, a second run finds
    the file instead of tokenising again, and a streamed run (data.streaming: the corpus never
    in memory) builds the same file in an empty cache and trains the same."""
    from tk.core.engine.inference import load_run
    from tk.plugins.mlm.data import make_sequences

    corpus = counting_corpus(tmp_path / "count.txt")
    args = ["run", "mlm_synthetic", *FAST, "data.source=text", f"data.path={corpus}", "data.max_len=16",
            "train.max_steps=6", "train.eval_every=3", "train.log_every=1"]
    for name, cache in (("plain", "false"), ("cached", "true"), ("again", "true")):
        result = run_cli(*args, f"data.token_cache={cache}", f"output_dir={tmp_path / name}")
        assert result.exit_code == 0, result.output

    def losses(name):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("loss"), r.get("val/loss")) for r in rows]

    monkeypatch.setenv("TK_CACHE", str(tmp_path / "empty_cache"))
    result = run_cli(*args, "data.streaming=true", f"output_dir={tmp_path / 'streamed'}")
    assert result.exit_code == 0, result.output
    assert losses("plain") == losses("cached") == losses("again") == losses("streamed") and len(losses("plain")) >= 6
    assert "from the cache" not in (tmp_path / "streamed" / "train.log").read_text()
    assert "from the cache" in (tmp_path / "again" / "train.log").read_text()
    task, _ = load_run(tmp_path / "cached")
    cached = task.build_dataset("train")
    seqs, _ = make_sequences(task.tokenizer, task.texts["train"], 16, True)
    assert type(cached).__name__ == "PackedTokens" and [cached[i]["input_ids"] for i in range(len(cached))] == seqs


def test_a_streamed_hub_corpus_splits_as_the_downloaded_one(tmp_path):
    import datasets

    docs = ["the cat sat on the mat", "", "a dog ran in the park", "the bird sang"] * 20
    folder = tmp_path / "hub_ds"
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(folder))
    common = ["data.source=hf", f"data.hf_name={folder}", "data.text_column=body", "data.val_fraction=0.1"]
    memory = make_task(tmp_path / "a", common).texts
    streamed = make_task(tmp_path / "b", [*common, "data.streaming=true"]).texts
    assert list(streamed["train"]) == memory["train"] and streamed["val"] == memory["val"]
    assert len(streamed["train"]) == 54 and [len(b) for b in streamed["train"].batches(25)] == [25, 25, 4]
    result = run_cli("validate", "mlm_synthetic", "data.streaming=true")
    assert result.exit_code == 2 and "data.streaming needs data.source text or hf" in result.output


def test_continued_pretraining_from_an_mlm_run(trained_run, tmp_path):
    """model.pretrained_from (#51 item 17: was an unknown key): the encoder and the tokenizer of an mlm
    run seed a new one through the one-line pretrained_backbone; a shape key against it is one line."""
    from tk.core.engine.inference import load_run

    result = run_cli("run", "mlm_synthetic", f"output_dir={tmp_path / 'more'}", *FAST, "data.max_len=16",
                     f"model.pretrained_from={trained_run}", "train.max_steps=0")
    assert result.exit_code == 0, result.output
    assert "tensors under 'encoder.' from the mlm run" in (tmp_path / "more" / "train.log").read_text()
    tok = "artifacts/tokenizer.json"
    assert (tmp_path / "more" / tok).read_bytes() == (trained_run / tok).read_bytes()
    _, before = load_run(trained_run)
    _, after = load_run(tmp_path / "more")
    for name, t in after.state_dict().items():
        assert torch.equal(t, before.state_dict()[name]) or not name.startswith("encoder."), name
    result = run_cli("run", "mlm_synthetic", f"output_dir={tmp_path / 'bad'}", *FAST, "model.dim=48",
                     f"model.pretrained_from={trained_run}")
    assert result.exit_code == 2 and "model.dim: the recipe sets 48" in result.output
