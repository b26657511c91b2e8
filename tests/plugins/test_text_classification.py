"""Tests for the text_classification plugin: core TextEncoder (pooling, BERT conversion),
tokenizer truncation, label handling and errors, end-to-end learning vs bag-of-words, predict,
metrics files, multi-label, fine-tuning (hub id, layer decay)."""

import dataclasses
import json
import re

import pytest
import torch
import transformers
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.errors import TkError
from tk.core.exchange.hf.bert import bert_config, load_bert_weights, read_bert_config
from tk.core.nn.config import TransformerConfig
from tk.core.nn.text_encoder import TextEncoder, pool
from tk.core.text import BERT_SPECIALS, BERT_TEMPLATE, TextTokenizer
from tk.plugins.text_classification.data import DataConfig, TextClsTokenizerConfig, read_rows
from tk.plugins.text_classification.synthetic import synthetic_rows

SMALL_RUN = ["train.progress=false", "train.num_workers=0", "model.dim=32", "model.depth=1", "tokenizer.vocab_size=100"]


def run_cli(args, **kwargs):
    result = CliRunner().invoke(cli, args, catch_exceptions=False, **kwargs)
    assert result.exit_code == 0, result.output
    return result


def test_mean_and_max_pooling_ignore_pad():
    torch.manual_seed(0)
    enc = TextEncoder(TransformerConfig(dim=16, depth=1, num_heads=2, dropout=0.0, max_len=12), 30).eval()
    short = torch.tensor([[5, 6, 7]])
    batch = torch.tensor([[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6]])  # row 0 = short + PAD
    alone, padded = enc(short), enc(batch)
    mask = enc.padding_mask(batch)
    for how in ("mean", "max"):
        expected = alone[0].mean(0) if how == "mean" else alone[0].amax(0)  # by hand, no PAD present
        torch.testing.assert_close(pool(padded, mask, how)[0], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(padded.mean(1)[0], alone[0].mean(0), atol=1e-3)  # PAD would change a naive mean


def test_truncation_is_counted():
    cfg = TextClsTokenizerConfig(kind="wordpiece", vocab_size=40, lowercase=True)
    tok = TextTokenizer.train(["a b c d e f g h"] * 10, cfg, BERT_SPECIALS, BERT_TEMPLATE)
    enc = tok.encode_batch(["a b", "a b c d e f g h", "a b c d"], max_length=5)
    ids, cut = enc.ids, enc.truncated
    assert cut == 2  # 10 and 6 tokens with [CLS]/[SEP] exceed 5; 4 does not
    assert [len(i) for i in ids] == [4, 5, 5]
    assert ids[1][0] == tok.token_id("[CLS]") and ids[1][-1] == tok.token_id("[SEP]")
    pair_types = tok.encode_batch(["a b"], ["c d"], max_length=16).type_ids
    assert pair_types[0] == [0, 0, 0, 0, 1, 1, 1]


def test_bert_checkpoint_matches_transformers(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=24)
    ref = transformers.BertModel(hf_cfg).eval()
    ref.save_pretrained(tmp_path)
    cfg, vocab, types = bert_config(read_bert_config(tmp_path))
    enc = TextEncoder(cfg, vocab, types).eval()
    load_bert_weights(enc, tmp_path)
    ids = torch.randint(1, 60, (3, 9))
    ids[1, 5:] = 0
    ids[2, 2:] = 0
    token_types = torch.zeros_like(ids)
    token_types[0, 4:] = 1
    attn = (ids != 0).long()
    expected = ref(input_ids=ids, attention_mask=attn, token_type_ids=token_types).last_hidden_state
    got = enc(ids, token_types)
    keep = attn.bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-5)


def test_unsupported_bert_option_is_named(tmp_path):
    cfg = transformers.BertConfig(position_embedding_type="relative_key").to_dict()
    with pytest.raises(TkError, match="position_embedding_type 'relative_key'"):
        bert_config(cfg)
    with pytest.raises(TkError, match="config.json does not exist"):
        read_bert_config(tmp_path / "nowhere")


def write_tsv(path, rows):
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    return path


def test_bad_rows_name_file_and_line(tmp_path):
    write_tsv(tmp_path / "t.tsv", [("good film", "pos"), ("", "neg")])
    d = DataConfig(source="files", train_file=str(tmp_path / "t.tsv"), val_file=str(tmp_path / "t.tsv"))
    with pytest.raises(TkError, match=r"t\.tsv:3: missing or empty 'sentence'"):
        read_rows(d, "train")
    d.train_file = str(tmp_path / "missing.tsv")
    with pytest.raises(TkError, match="data.train_file: .*missing.tsv does not exist"):
        read_rows(d, "train")


def test_string_labels_round_trip_and_unseen_label(tmp_path):
    rows = [(t, "yes" if y == "positive" else "no") for t, y in synthetic_rows(64, 0)]
    train, val = write_tsv(tmp_path / "train.tsv", rows), write_tsv(tmp_path / "dev.tsv", rows[:16])
    run_dir = tmp_path / "run"
    files = ["data.source=files", f"data.train_file={train}", f"data.val_file={val}"]
    run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", *files, "train.max_steps=2", *SMALL_RUN])
    assert json.loads((run_dir / "artifacts" / "labels.json").read_text()) == ["no", "yes"]
    task, model = load_run(run_dir, "last", [])
    assert task.labels == ["no", "yes"]
    [pred] = task.predict(model, ["good , not bad"])
    assert pred["label"] in ("no", "yes") and set(pred["probs"]) == {"no", "yes"}
    assert abs(sum(pred["probs"].values()) - 1) < 1e-5
    write_tsv(val, rows[:3] + [("fine film", "maybe")])
    with pytest.raises(TkError, match=r"dev\.tsv:5: label 'maybe' is not among"):
        task.build_dataset("val")


def bag_of_words_accuracy(train, val) -> float:
    """Logistic regression on word counts (full-batch Adam, torch), val accuracy."""
    vocab = {w: i for i, w in enumerate(sorted({w for t, _ in train for w in t.split()}))}
    labels = sorted({y for _, y in train})

    def counts(rows):
        x = torch.zeros(len(rows), len(vocab))
        for r, (t, _) in enumerate(rows):
            for w in t.split():
                if w in vocab:
                    x[r, vocab[w]] += 1
        return x, torch.tensor([labels.index(y) for _, y in rows])

    (xt, yt), (xv, yv) = counts(train), counts(val)
    lin = torch.nn.Linear(len(vocab), len(labels))
    opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(lin(xt), yt).backward()
        opt.step()
    return (lin(xv).argmax(-1) == yv).float().mean().item()


@pytest.mark.slow
def test_synthetic_run_beats_bag_of_words_and_predicts_from_stdin(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", "data.num_train=2000", "train.max_steps=250",
             "train.eval_every=250", "optim.lr=3e-3", "train.progress=false", "train.num_workers=0"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = [m["val/top1"] for m in metrics if "val/top1" in m][-1]
    bow = bag_of_words_accuracy(synthetic_rows(2000, 0), synthetic_rows(500, 1))  # the recipe's splits
    assert bow < 0.75, f"the synthetic corpus should defeat bag-of-words, got {bow:.3f}"
    assert acc > bow + 0.2, f"encoder {acc:.3f} vs bag-of-words {bow:.3f}"

    val = synthetic_rows(20, 1)[:20]  # the first val sentences
    result = run_cli(["predict", str(run_dir), "-"], input="".join(f"{t}\n" for t, _ in val))
    records = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [r["input"] for r in records] == [t for t, _ in val]
    hits = sum(r["label"] == y for r, (_, y) in zip(records, val))
    assert hits >= 17, f"tk predict got {hits}/20 validation sentences right"
    assert all(set(r["probs"]) == {"negative", "positive"} for r in records)


def test_fine_tune_from_hub_id_then_predict_without_it(tmp_path, monkeypatch, caplog):
    import shutil

    import huggingface_hub

    words = sorted({w for t, _ in synthetic_rows(200, 0) for w in t.split()})
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(
        vocab_size=5 + len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40))
    hf.save_pretrained(folder)
    downloads = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kw: downloads.append(repo_id) or str(folder))  # the hub, offline
    run_dir = tmp_path / "run"
    common = ["model.pretrained_from=someone/tiny-bert", "model.encoder_lr_scale=0.1", "optim.lr=1e-9",
              "train.max_steps=1", "data.num_train=64", "data.num_val=16", "train.progress=false",
              "train.num_workers=0"]
    # shape keys typed beside the source that config.json contradicts: one line, even at a default (4 heads)
    typed = CliRunner().invoke(cli, ["run", "textcls_synthetic", f"output_dir={tmp_path / 'typed'}", *common,
                                     "model.dim=64", "model.num_heads=8"])
    assert typed.exit_code == 2 and len(typed.stderr.strip().splitlines()) == 1, typed.output
    assert "model.dim=64 (config.json: 32), model.num_heads=8 (config.json: 4)" in typed.stderr
    downloads.clear()
    with caplog.at_level("WARNING"):
        run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", *common])
    assert downloads == ["someone/tiny-bert"]  # once: setup and init_pretrained share the folder
    built = [r.getMessage() for r in caplog.records if "built as its config.json says" in r.getMessage()]
    assert len(built) == 1 and "dim=32 (recipe: 64)" in built[0], built  # the recipe file's 64
    assert "hidden_dim=64 (recipe:" in built[0] and "norm_first=False (recipe: True)" in built[0], built  # defaults too
    log = (run_dir / "train.log").read_text()
    assert "model.pretrained_from: 29 encoder tensors from someone/tiny-bert (BERT), and its pooler" in log
    shutil.rmtree(folder)  # eval/predict use the run's own files and weights
    task, model = load_run(run_dir, "last", [])
    assert task.tokenizer.token_id("good") == 5 + words.index("good")  # the folder's vocabulary, not a trained one
    torch.testing.assert_close(model.encoder.tok_embed.weight, hf.embeddings.word_embeddings.weight, atol=1e-6, rtol=0)
    assert model.encoder.cfg.dim == 32 and not model.encoder.cfg.norm_first
    # an HF source brings BERT's pooler (model.pooler left null), pretrained weights included
    torch.testing.assert_close(model.pooler.weight, hf.pooler.dense.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.pooler.bias, hf.pooler.dense.bias, atol=1e-6, rtol=0)
    [pred] = task.predict(model, ["the film was not bad"])
    assert pred["label"] in ("negative", "positive")

    def lrs(optim_cfg):
        """lr of each parameter name."""
        return {n: g["lr"] for g in task.param_groups(model, optim_cfg) for n in g["param_names"]}

    lr = lrs(task.cfg.optim)
    assert lr["encoder.tok_embed.weight"] == pytest.approx(0.1 * lr["head.weight"])
    decayed = lrs(dataclasses.replace(task.cfg.optim, layer_decay=0.5, lr=1.0))
    assert decayed["head.weight"] == decayed["head.bias"] == decayed["pooler.weight"] == 1.0  # the head: full lr
    for layer, scale in ((1, 0.5), (0, 0.25)):  # top layer 0.5 ** 1, the one below 0.5 ** 2 (x encoder 0.1)
        assert decayed[f"encoder.encoder.layers.{layer}.mlp.fc1.weight"] == pytest.approx(0.1 * scale)
    for name in ("encoder.tok_embed.weight", "encoder.pos_embed.weight", "encoder.embed_norm.weight"):
        assert decayed[name] == pytest.approx(0.1 * 0.5 ** 3)  # embeddings lowest


def test_pretrained_dir_resolution(tmp_path, monkeypatch):
    import huggingface_hub

    from tk.core.exchange.hf.bert import resolve_pretrained_dir

    def no_network(repo_id, **kw):
        raise OSError(f"offline: cannot reach the hub for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert resolve_pretrained_dir(str(tmp_path)) == tmp_path  # an existing folder: never the hub
    with pytest.raises(TkError, match=r"'owner/model' is no path on disk, and as a Hugging Face hub id it could not be "
                                      r"fetched \(offline"):
        resolve_pretrained_dir("owner/model")
    with pytest.raises(TkError, match="model.pretrained_from: .*nowhere/at/all does not exist"):
        resolve_pretrained_dir(str(tmp_path / "nowhere" / "at" / "all"))  # a path, not a hub id


@pytest.mark.slow
def test_hf_datasets_source_reads_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # read when datasets is first imported
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "t.csv").write_text("sentence,label\ngood film,pos\nbad film,neg\n")
    d = DataConfig(source="hf", hf_name="csv", hf_data_files={"train": str(tmp_path / "t.csv")})
    assert [(r[0], r[2]) for r in read_rows(d, "train")] == [("good film", "pos"), ("bad film", "neg")]
    d.hf_name = "no_such_builder_xyz"
    with pytest.raises(TkError, match="data.hf_name: cannot load 'no_such_builder_xyz'"):
        read_rows(d, "train")


def test_per_class_precision_recall_and_confusion_files(tmp_path):
    from tk.core.step import EvalContext, StepOutput
    from tk.core.text import ClassificationMetrics

    metric = ClassificationMetrics(["a", "b", "c"])
    target = torch.tensor([0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 1, 1, 0, 1])  # c is never predicted
    metric.update(StepOutput(loss=torch.zeros(()), num_items=6, outputs=torch.nn.functional.one_hot(pred, 3).float()),
                  {"labels": target})
    rows = {r[0]: r[1:] for r in metric.per_class()}
    # by hand: a: tp 2, predicted 3, support 3; b: tp 1, predicted 3, support 2; c: tp 0, predicted 0, support 1
    assert rows["a"][:2] == (3, 3) and rows["a"][2] == pytest.approx(2 / 3) and rows["a"][3] == pytest.approx(2 / 3)
    assert rows["b"][2] == pytest.approx(1 / 3) and rows["b"][3] == pytest.approx(1 / 2)
    assert rows["b"][4] == pytest.approx(2 * 1 / (2 * 1 + 2 + 1))
    assert rows["c"][2] != rows["c"][2] and rows["c"][3] == 0.0  # precision NaN: never predicted
    assert metric.compute()["macro_f1"] == pytest.approx((2 / 3 + 0.4 + 0.0) / 3)
    metric.write(tmp_path, EvalContext(split="val"))
    lines = (tmp_path / "val_confusion.tsv").read_text().splitlines()
    assert lines == ["true\\predicted\ta\tb\tc", "a\t2\t1\t0", "b\t1\t1\t0", "c\t0\t1\t0"]
    assert (tmp_path / "val_per_class.tsv").read_text().splitlines()[2] == "b\t2\t3\t0.3333\t0.5000\t0.4000"
    assert (tmp_path / "val_confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def multi_label_rows(n, seed):
    """Texts of filler words plus one cue word per topic; the labels are the topics present."""
    import random

    rng = random.Random(seed)
    cues = {"sport": ["ball", "goal", "team"], "music": ["song", "band", "drum"], "food": ["bread", "soup", "rice"]}
    filler = ["the", "a", "today", "big", "old", "we", "saw", "very", "and", "then"]
    rows = []
    for _ in range(n):
        topics = [t for t in cues if rng.random() < 0.5] or [rng.choice(list(cues))]
        words = rng.sample(filler, 4) + [rng.choice(cues[t]) for t in topics]
        rng.shuffle(words)
        rows.append((" ".join(words), "|".join(topics)))
    return rows


@pytest.mark.slow
def test_multi_label_learns_and_predicts_label_sets(tmp_path):
    val_rows = multi_label_rows(80, 1)
    train = write_tsv(tmp_path / "train.tsv", multi_label_rows(320, 0))
    val = write_tsv(tmp_path / "dev.tsv", val_rows)
    run_dir = tmp_path / "run"
    run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", "data.source=files", f"data.train_file={train}",
             f"data.val_file={val}", "data.multi_label=true", "data.label_delimiter='|'", "model.pooling=mean",
             "optim.lr=3e-3", "train.max_steps=100", "train.eval_every=100", "train.batch_size=32",
             "train.best_metric=val/subset_acc", *SMALL_RUN])
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["val/micro_f1"] > 0.9 and final["val/macro_f1"] > 0.9, final
    assert json.loads((run_dir / "artifacts" / "labels.json").read_text()) == ["food", "music", "sport"]
    assert (run_dir / "eval" / "val_per_class.tsv").read_text().startswith("class\tsupport\tpredicted")
    task, model = load_run(run_dir, "last", [])
    preds = task.predict(model, [t for t, _ in val_rows])
    exact = sum(p["labels"] == sorted(y.split("|")) for p, (_, y) in zip(preds, val_rows))
    assert exact >= 0.8 * len(val_rows), f"{exact}/{len(val_rows)} label sets right"
    assert all(set(p["probs"]) == {"food", "music", "sport"} for p in preds)
    write_tsv(val, [("a soup", "food|wine")])
    with pytest.raises(TkError, match=r"dev\.tsv:2: label 'wine' is not among"):
        task.build_dataset("val")


def test_bpe_tokenizer_on_text_pairs_end_to_end(tmp_path):
    rows = [(t, u, "same" if (y == "positive") == (v == "positive") else "differ")
            for (t, y), (u, v) in zip(synthetic_rows(48, 0), synthetic_rows(48, 5))]
    for name, part in (("train.tsv", rows), ("dev.tsv", rows[:12])):
        (tmp_path / name).write_text("premise\thypothesis\tlabel\n" + "".join(f"{a}\t{b}\t{y}\n" for a, b, y in part))
    run_dir = tmp_path / "run"
    run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", "data.source=files",
             f"data.train_file={tmp_path / 'train.tsv'}", f"data.val_file={tmp_path / 'dev.tsv'}",
             "data.text_column=premise", "data.text_pair_column=hypothesis", "tokenizer.kind=bpe",
             "train.max_steps=2", *SMALL_RUN, "tokenizer.vocab_size=300", "data.max_len=64"])  # bpe: the 256 bytes + merges
    tok = json.loads((run_dir / "artifacts" / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE"
    task, model = load_run(run_dir, "last", [])
    [item] = [task.build_dataset("val")[0]]
    sep = task.tokenizer.token_id("[SEP]")
    first_sep = item["input_ids"].index(sep)
    assert set(item["token_types"][: first_sep + 1]) == {0} and set(item["token_types"][first_sep + 1:]) == {1}
    result = run_cli(["predict", str(run_dir), "-"], input=f"{rows[0][0]}\t{rows[0][1]}\n")
    [record] = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert record["label"] in ("same", "differ") and set(record["probs"]) == {"same", "differ"}
    with pytest.raises(TkError, match="give the two texts separated by a tab"):
        task.predict(model, ["only one text"])


def test_multi_label_config_and_rows_errors(tmp_path):
    from tk.plugins.text_classification.data import check_data

    assert any("data.multi_label needs data.source" in p for p in check_data(DataConfig(multi_label=True)))
    (tmp_path / "t.tsv").write_text("sentence\tlabel\ngood\ta| b |a\nbad\t | \n")
    d = DataConfig(source="files", train_file=str(tmp_path / "t.tsv"), val_file=str(tmp_path / "t.tsv"),
                   multi_label=True, label_delimiter="|")
    with pytest.raises(TkError, match=r"t\.tsv:3: no labels in 'label'"):
        read_rows(d, "train")
    (tmp_path / "t.tsv").write_text("sentence\tlabel\ngood\ta| b |a\n")
    assert read_rows(d, "train")[0][2] == ("a", "b")  # stripped, distinct, sorted


def test_rotary_and_no_position_encoders():
    torch.manual_seed(0)
    ids = torch.tensor([[5, 6, 7, 8]])
    for how in ("rotary", "none"):
        cfg = TransformerConfig(dim=16, depth=1, num_heads=2, dropout=0.0, max_len=12, pos_encoding=how)
        enc = TextEncoder(cfg, 30).eval()
        assert enc.pos_embed is None and not any("pos_embed" in n for n, _ in enc.named_parameters())
        padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
        torch.testing.assert_close(enc(padded)[:, :4], enc(ids), atol=1e-5, rtol=1e-5)  # PAD changes nothing
        swapped = enc(ids[:, [1, 0, 2, 3]])
        order_blind = torch.allclose(swapped[0, 0], enc(ids)[0, 1], atol=1e-5)
        assert order_blind == (how == "none")  # without positions, a permutation only permutes the states


def test_rotary_run_with_ema_predicts_with_the_ema_weights(tmp_path):
    """SST-2's recipe shape (rotary positions, an EMA selecting the best checkpoint) trains,
    and `tk predict` uses the EMA weights (those exported to model_ema.safetensors), the ones the
    run selected, unless told `--raw`."""
    run_dir = tmp_path / "run"
    run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", "model.pos_encoding=rotary", "train.max_steps=4",
             "train.eval_every=4", "train.ema_decay=0.5", "train.best_metric=val_ema/top1", *SMALL_RUN])
    text = "good, not bad\n"

    def probs(*extra):
        out = run_cli(["predict", str(run_dir), "-", "--checkpoint", "last", *extra], input=text).stdout
        return json.loads(out.strip())["probs"]

    ema, raw = probs("--ema"), probs("--raw")
    assert ema == probs("--weights", str(run_dir / "model_ema.safetensors")) and ema != raw
    assert probs() == ema  # by default, the weights the run selected by val_ema/*


@pytest.mark.parametrize("old, value, new", [
    ("data.tokenizer", "bpe", "tokenizer.kind"), ("data.vocab_size", "100", "tokenizer.vocab_size"),
    ("data.lowercase", "false", "tokenizer.lowercase"), ("data.hf_splits", "{val: test}", "data.hf_split")])
def test_renamed_keys_are_one_line_errors_naming_the_new_key(old, value, new, tmp_path):
    section, key = old.split(".")
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"task: text_classification\n{section}: {{source: synthetic, {key}: {value}}}\n")
    for args in (["run", "textcls_synthetic", f"output_dir={tmp_path / 'run'}", f"{old}={value}"],
                 ["run", str(recipe), f"output_dir={tmp_path / 'run'}"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and f"{old} was renamed to {new}" in lines[0], result.output
    assert not (tmp_path / "run").exists()


def test_given_tokenizer_path_and_sinusoidal_positions(tmp_path):
    """tokenizer.path: a given tokenizer.json is used as is (not retrained), with BERT's
    template; one lacking [CLS] is a one-line error naming the key."""
    cfg = TextClsTokenizerConfig(kind="wordpiece", vocab_size=80)
    texts = [t for t, _ in synthetic_rows(200, 3)]
    given = TextTokenizer.train(texts, cfg, BERT_SPECIALS)  # no template: the task adds it
    given.save(tmp_path / "tok.json")
    run_dir = tmp_path / "run"
    run_cli(["run", "textcls_synthetic", f"output_dir={run_dir}", f"tokenizer.path={tmp_path / 'tok.json'}",
             "model.pos_encoding=sinusoidal", "train.max_steps=2", *SMALL_RUN])
    task, model = load_run(run_dir, "last", [])
    assert task.tokenizer.tok.get_vocab() == given.tok.get_vocab()
    assert not any("pos_embed" in n for n, _ in model.named_parameters())  # a fixed table
    ids = task.build_dataset("val")[0]["input_ids"]
    assert ids[0] == given.token_id("[CLS]") and ids[-1] == given.token_id("[SEP]")
    TextTokenizer.train(texts, cfg, ["[PAD]", "[UNK]"]).save(tmp_path / "bad.json")
    result = CliRunner().invoke(cli, ["run", "textcls_synthetic", f"output_dir={tmp_path / 'bad'}",
                                      f"tokenizer.path={tmp_path / 'bad.json'}", "train.max_steps=2", *SMALL_RUN])
    assert result.exit_code == 2 and "tokenizer.path:" in result.output and "[CLS]" in result.output, result.output


def test_predict_refuses_empty_and_too_long_texts_per_input(tmp_path):
    """An empty text gets no label and a text the model would see only in part is an error for
    that input (the others are predicted), unless predict.truncate=true."""
    run = tmp_path / "run"
    run_cli(["run", "textcls_synthetic", f"output_dir={run}", *SMALL_RUN, "train.max_steps=1",
             "data.num_train=64", "data.num_val=16", "data.max_len=16"])
    long_text = " ".join(["good , not bad"] * 20)
    result = CliRunner().invoke(cli, ["predict", str(run), "", "the film was good", long_text])
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 1 and "2 of 3 inputs failed" in result.stderr
    assert records[0]["error"] == "the text is empty; a classifier needs words to label"
    assert "label" in records[1]
    assert re.search(r"the text has \d+ tokens, more than the 16 the model takes \(data.max_len\); shorten it, or "
                    r"pass predict.truncate=true", records[2]["error"])
    cut = CliRunner().invoke(cli, ["predict", str(run), long_text, "predict.truncate=true"])
    assert cut.exit_code == 0 and "label" in json.loads(cut.stdout)


@pytest.mark.slow
def test_two_fresh_runs_with_one_seed_train_the_same_tokenizer_and_losses(tmp_path):
    """Issue #35 item 4: a run trains its WordPiece vocabulary in its own process; the same seed
    gives the same tokenizer.json, byte for byte, and the same loss at every step."""
    import subprocess
    import sys

    args = ["textcls_synthetic", "data.num_train=512", "data.num_val=64", "train.epochs=1", "train.log_every=2",
            "train.eval_every=8", "train.progress=false", "tokenizer.vocab_size=120"]
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "tk", "run", *args, f"output_dir={tmp_path / name}"], check=True,
                       capture_output=True)
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "artifacts/tokenizer.json").read_bytes() == (b / "artifacts/tokenizer.json").read_bytes()

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("loss"), r.get("val/loss")) for r in rows]

    assert len(losses(a)) >= 9 and losses(a) == losses(b)


@pytest.mark.slow
def test_a_packed_run_trains_and_evaluates_as_the_padded_run(tmp_path):
    """data.pack (issue #36 item 4): without dropout, every logged loss and metric of a packed run
    equals the padded run's (to float rounding); the packed batches hold fewer padded tokens."""
    args = ["textcls_synthetic", "data.num_train=256", "data.num_val=64", "train.epochs=1", "train.log_every=2",
            "train.eval_every=4", "train.progress=false", "tokenizer.vocab_size=120", "model.dropout=0.0",
            "model.head_dropout=0.0", "data.max_len=48"]
    rows = {}
    for pack in ("false", "true"):
        run_cli(["run", *args, f"data.pack={pack}", f"output_dir={tmp_path / pack}"])
        rows[pack] = [json.loads(line) for line in (tmp_path / pack / "metrics.jsonl").read_text().splitlines()]
    assert len(rows["true"]) == len(rows["false"]) >= 6
    for padded, packed in zip(rows["false"], rows["true"]):
        for key in ("loss", "val/loss", "val/top1", "val/macro_f1"):
            if key in padded:
                assert packed[key] == pytest.approx(padded[key], abs=1e-5), (padded["step"], key)
    task, _ = load_run(tmp_path / "true")
    batch = task.collate([task.build_dataset("train")[i] for i in range(16)])
    assert batch["segments"].amax(1).sum() == 16 and batch["input_ids"].shape[0] < 16
