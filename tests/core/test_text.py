"""tk.core.text: tokenizer kinds (train, save, reload, specials, char ids), loading errors, the
record reader's file:line errors, the datasets loader's one-line errors, and the text metrics."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from tk.core.errors import TkError
from tk.core.step import EvalContext, StepOutput
from tk.core.text import (
    BERT_SPECIALS,
    BERT_TEMPLATE,
    ClassificationMetrics,
    MultiLabelMetrics,
    Perplexity,
    TextTokenizer,
    TokenizerConfig,
    build_tokenizer,
    iter_column,
    load_hub_dataset,
    read_lines,
    read_parallel,
    read_records,
)
from tk.core.text import tokenizer as tokenizer_module

TEXTS = ["The cat sat on the mat.\nA second line, with ünïcode!", "the dog ran far away from the cat"] * 40
SAMPLE = "the cat ran away\nfrom the dog."
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece", "unigram"])
def test_each_kind_trains_saves_and_reloads_with_the_same_ids(kind, tmp_path):
    cfg = TokenizerConfig(kind=kind, vocab_size=300, min_frequency=1)
    tok = TextTokenizer.train(iter(TEXTS), cfg, SPECIALS)
    assert tok.kind == kind
    assert tok.special_ids == {s: i for i, s in enumerate(SPECIALS)}  # the given order
    ids = tok.encode(SAMPLE)
    tok.save(tmp_path / "tokenizer.json")
    again = TextTokenizer.load(tmp_path / "tokenizer.json", required_specials=SPECIALS)
    assert again.kind == kind and again.vocab_size == tok.vocab_size
    assert again.encode(SAMPLE) == ids == TextTokenizer.from_str(tok.to_str()).encode(SAMPLE)
    assert again.encode_batch([SAMPLE, "cat"]).ids == [ids, tok.encode("cat")]
    if kind == "wordpiece":  # BERT pre-tokenisation drops the newline
        assert again.decode(ids) == "the cat ran away from the dog."
    else:  # char, byte-level BPE and Metaspace unigram restore the text
        assert again.decode(ids) == SAMPLE
        assert again.decode_batch([ids]) == [SAMPLE]


@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece", "unigram"])
def test_lowercase_applies_to_every_kind(kind):
    tok = TextTokenizer.train(TEXTS, TokenizerConfig(kind=kind, vocab_size=300, lowercase=True, min_frequency=1),
                              ["<unk>"])
    assert tok.encode("THE CAT") == tok.encode("the cat")


def test_char_ids_equal_the_old_char_tokenizer():
    corpus = "".join(TEXTS) + "\t~{}"
    index = {c: i + 1 for i, c in enumerate(sorted(set(corpus)))}  # the old CharTokenizer: <unk> 0, sorted chars

    def old(text):
        return [index.get(c, 0) for c in text]

    new = TextTokenizer.train([corpus], TokenizerConfig(kind="char"), ["<unk>"])
    probe = "The cat, Zebra ÿ\n\tünïcode~ 🙂"  # unseen characters map to <unk> (id 0)
    assert new.vocab_size == len(index) + 1
    assert new.encode(probe) == old(probe)
    lines = probe.splitlines(keepends=True)
    assert new.encode_batch(lines).ids == [old(line) for line in lines]
    # the dict fast path equals the tokenizers pipeline it stands for
    assert new.encode_batch(lines).ids == [e.ids for e in new.tok.encode_batch(lines)]
    assert new.decode(new.encode("cat\n"), skip_special_tokens=False) == "cat\n"


def test_bert_template_pairs_truncation_and_token_ids():
    tok = TextTokenizer.train(TEXTS, TokenizerConfig(kind="wordpiece", vocab_size=200, lowercase=True),
                              BERT_SPECIALS, BERT_TEMPLATE)
    cls, sep = tok.token_id("[CLS]"), tok.token_id("[SEP]")
    enc = tok.encode_batch(["the cat", "the cat sat on the mat"], ["the dog", "the dog ran far away"], max_length=8)
    assert enc.ids[0][0] == cls and enc.ids[0].count(sep) == 2 and len(enc.ids[1]) == 8
    assert enc.type_ids[0] == [0, 0, 0, 0, 1, 1, 1] and enc.truncated == 1
    assert tok.encode("the cat", add_special_tokens=False) == enc.ids[0][1:3]
    with pytest.raises(TkError, match=r"has no token '<mask>'"):
        tok.token_id("<mask>")


def test_hf_folder_with_only_vocab_txt(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    tok = TextTokenizer.load(tmp_path, required_specials=BERT_SPECIALS)
    assert tok.kind == "wordpiece"
    assert tok.encode("The CATS sat") == [2, 4, 5, 7, 6, 3]  # [CLS] the cat ##s sat [SEP]


def test_bad_tokenizer_paths_are_one_line_naming_the_key(tmp_path, monkeypatch):
    with pytest.raises(TkError) as e:
        TextTokenizer.load(tmp_path / "missing.json")
    assert "tokenizer.path" in one_line(e) and "tokenizer file not found" in str(e.value)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TkError) as e:
        TextTokenizer.load(tmp_path / "bad.json")
    assert one_line(e).startswith("tokenizer.path:") and "not a tokenizers tokenizer.json" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TkError, match="tokenizer.path: folder .* has neither tokenizer.json nor vocab.txt"):
        TextTokenizer.load(tmp_path / "empty")

    def offline(name):
        raise OSError(f"cannot reach the hub for {name}\nsecond line")

    monkeypatch.setattr(tokenizer_module, "_from_hub", offline)
    with pytest.raises(TkError) as e:
        TextTokenizer.load("owner/model")
    assert one_line(e).startswith("tokenizer.path: 'owner/model' is not a file or folder here")
    TextTokenizer.train(TEXTS, TokenizerConfig(kind="char"), ["<unk>"]).save(tmp_path / "c.json")
    with pytest.raises(TkError, match=r"lacks the special tokens \['<pad>'\]"):
        build_tokenizer(TokenizerConfig(path=str(tmp_path / "c.json")), [], ["<pad>", "<unk>"])


def test_build_tokenizer_trains_without_a_path():
    tok = build_tokenizer(TokenizerConfig(kind="char"), iter(TEXTS), ["<unk>"])
    assert tok.source == "trained" and tok.special_ids == {"<unk>": 0}


# the reader ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, body, where, what", [
    ("csv", 'text,label\n"a, b",pos\nc,neg,extra\n', ":3:", "3 comma-separated fields, expected 2"),
    ("tsv", "text\tlabel\ngood\tpos\nbad\n", ":3:", "1 tab-separated fields, expected 2"),
    ("jsonl", '{"text": "a", "label": 1}\n\n{"text": "b"\n', ":3:", "not valid JSON"),
    ("jsonl", '{"text": "a", "label": 1}\n["b"]\n', ":2:", "expected a JSON object"),
    ("jsonl", '{"text": "a", "label": 1}\n{"text": "b"}\n', ":2:", "missing 'label'"),
    ("txt", "one\ntwo\n", ":1:", "missing 'label'"),
])
def test_reader_names_file_and_line_of_a_bad_row(tmp_path, fmt, body, where, what):
    path = tmp_path / f"rows.{fmt}"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(TkError) as e:
        list(read_records(path, required={"text": "data.text_column", "label": "data.label_column"}))
    assert f"rows.{fmt}{where}" in one_line(e) and what in str(e.value)


def test_reader_records_lines_and_utf8(tmp_path):
    (tmp_path / "a.csv").write_text('\ufefftext,label\n"multi\nline",pos\n\nb,neg\n', encoding="utf-8")
    records = list(read_records(tmp_path / "a.csv", required=["text"]))
    assert [(r.data, r.line) for r in records] == [({"text": "multi\nline", "label": "pos"}, 3),
                                                   ({"text": "b", "label": "neg"}, 5)]
    assert records[1].where.endswith("a.csv:5")
    (tmp_path / "a.tsv").write_text('say "hi"\tpos\n')  # TSV is unquoted; fieldnames = no header line
    assert next(read_records(tmp_path / "a.tsv", fieldnames=["src", "tgt"])).data == {"src": 'say "hi"', "tgt": "pos"}
    (tmp_path / "b.tsv").write_text("text\tlabel\n\tneg\n")
    with pytest.raises(TkError, match=r"b\.tsv:2: missing or empty 'text' .*set data.text_column"):
        list(read_records(tmp_path / "b.tsv", required={"text": "data.text_column"}, allow_empty=False))
    (tmp_path / "bad.txt").write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(TkError, match=r"bad\.txt:2: not valid UTF-8"):
        read_lines(tmp_path / "bad.txt")


def test_reader_empty_missing_and_unknown_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TkError, match=r"data.val_file: .*empty\.jsonl is empty"):
        list(read_records(tmp_path / "empty.jsonl", key="data.val_file"))
    (tmp_path / "head.csv").write_text("text,label\n")
    with pytest.raises(TkError, match=r"head\.csv has a header but no rows"):
        list(read_records(tmp_path / "head.csv"))
    with pytest.raises(TkError, match=r"data.train_file: .*nope\.tsv does not exist"):
        list(read_records(tmp_path / "nope.tsv"))
    (tmp_path / "x.parquet").write_text("x")
    with pytest.raises(TkError, match="cannot tell the format"):
        list(read_records(tmp_path / "x.parquet"))


def test_parallel_files(tmp_path):
    (tmp_path / "train.en").write_text("a\n\nc\n")
    (tmp_path / "train.de").write_text("x\ny\nz")
    assert read_parallel(tmp_path / "train.en", tmp_path / "train.de") == [("a", "x"), ("", "y"), ("c", "z")]
    (tmp_path / "train.de").write_text("x\ny\n")
    with pytest.raises(TkError, match=r"train\.en has 3 lines but .*train\.de has 2"):
        read_parallel(tmp_path / "train.en", tmp_path / "train.de")


# the datasets loader ---------------------------------------------------------------------------
@pytest.mark.parametrize("error, expect", [
    (ConnectionError("Couldn't reach 'glue' on the Hub (LocalEntryNotFoundError)"), "no network"),
    (ValueError("BuilderConfig 'x' not found. Available: ['cola', 'sst2']"),
     "set data.hf_config to one of ['cola', 'sst2']"),
    (ValueError('Unknown split "dev". Should be one of [\'train\', \'test\'].'),
     "set data.hf_split to one of ['train', 'test']"),
    (FileNotFoundError("Dataset 'nope' doesn't exist on the Hub or cannot be accessed."), "check data.hf_name"),
])
def test_hub_failures_are_one_line_naming_the_dataset(monkeypatch, error, expect):
    def load_dataset(*args, **kwargs):
        raise error

    config = types.SimpleNamespace(HF_HUB_OFFLINE=False, HF_DATASETS_OFFLINE=False)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset, config=config))
    with pytest.raises(TkError) as e:
        load_hub_dataset("glue", "x", split="dev")
    msg = one_line(e)
    assert msg.startswith("data.hf_name: cannot load 'glue' (config 'x', split 'dev')") and expect in msg, msg


def test_an_unreachable_hub_loads_offline_at_once_and_names_the_tasks_local_source(monkeypatch):
    """No connection: datasets runs in offline mode (a cached dataset loads; another fails with no
    retries), and the error names the local source the task accepts (issue #35 item 6)."""
    import huggingface_hub.constants as hub

    from tk.core.text import hub as hub_loader

    seen = []

    def load_dataset(*args, **kwargs):
        seen.append((hub.HF_HUB_OFFLINE, config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE))
        raise ConnectionError("Couldn't reach 'glue' on the Hub (OfflineModeIsEnabled)")

    config = types.SimpleNamespace(HF_HUB_OFFLINE=False, HF_DATASETS_OFFLINE=False)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset, config=config))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_loader, "_reachable", lambda endpoint, timeout=3.0: False)
    with pytest.raises(TkError) as e:
        load_hub_dataset("glue", "sst2", local="data.source: text with data.path")
    assert seen == [(True, True, True)] and not hub.HF_HUB_OFFLINE and not config.HF_HUB_OFFLINE  # restored
    assert "no network" in one_line(e) and one_line(e).endswith("use local files (data.source: text with data.path)")


def test_hub_loads_local_files_and_saved_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    (tmp_path / "t.csv").write_text("sentence,label\ngood film,pos\nbad film,neg\n")
    ds = load_hub_dataset("csv", data_files={"train": str(tmp_path / "t.csv")}, columns=["sentence"],
                          cache_dir=str(tmp_path / "cache"))
    assert ds["sentence"] == ["good film", "bad film"]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]})}).save_to_disk(str(saved))
    assert load_hub_dataset(str(saved), split="train")["text"] == ["a", "b"]
    assert [r["text"] for r in load_hub_dataset(str(saved), streaming=True)] == ["a", "b"]
    assert list(iter_column(load_hub_dataset(str(saved), streaming=True), "text", batch_size=1)) == [["a"], ["b"]]
    with pytest.raises(TkError, match=r"data.hf_split: .* has no split 'validation' \(it has \['train'\]\)"):
        load_hub_dataset(str(saved), split="validation")
    with pytest.raises(TkError, match=r"data.text_column: .* has no column 'body'"):
        load_hub_dataset(str(saved), columns={"body": "data.text_column"})


# metrics ---------------------------------------------------------------------------------------
def test_perplexity_is_exp_of_summed_loss_over_tokens():
    metric = Perplexity()
    metric.update(StepOutput(loss=torch.tensor(12.0), num_items=10), {})
    metric.update(StepOutput(loss=torch.tensor(3.0), num_items=5), {})
    assert metric.keys() == ["perplexity"]
    assert metric.compute()["perplexity"] == pytest.approx(math.exp((12.0 + 3.0) / (10 + 5)))
    assert math.isnan(Perplexity().compute()["perplexity"])


def test_classification_report_by_hand(tmp_path):
    # true 0,0,0,1,1,2 predicted 0,0,1,1,2,2: confusion [[2,1,0],[0,1,1],[0,0,1]]
    metric = ClassificationMetrics(["a", "b", "c"])
    target = torch.tensor([0, 0, 0, 1, 1, 2])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 0, 1, 1, 2, 2]), 3).float()
    metric.update(StepOutput(loss=torch.tensor(0.0), num_items=6, outputs=logits), {"labels": target})
    f1 = [2 * 2 / (4 + 0 + 1), 2 * 1 / (2 + 1 + 1), 2 * 1 / (2 + 1 + 0)]
    out = metric.compute()
    assert out["top1"] == pytest.approx(4 / 6) and out["macro_f1"] == pytest.approx(sum(f1) / 3)
    metric.write(tmp_path, EvalContext(split="val", step=1))
    assert (tmp_path / "val_confusion.tsv").read_text().splitlines()[1] == "a\t2\t1\t0"
    assert (tmp_path / "val_per_class.tsv").read_text().splitlines()[0].split("\t")[0] == "class"
    assert (tmp_path / "val_confusion.png").read_bytes()[:4] == b"\x89PNG"


def test_multilabel_keys():
    metric = MultiLabelMetrics(["x", "y"])
    logits = torch.tensor([[5.0, -5.0], [5.0, 5.0]])
    metric.update(StepOutput(loss=torch.tensor(0.0), num_items=2, outputs=logits),
                  {"labels": torch.tensor([[1.0, 0.0], [1.0, 0.0]])})
    assert metric.compute() == {"micro_f1": pytest.approx(0.8), "macro_f1": pytest.approx(0.5), "subset_acc": 0.5}


# -- reproducible training (issue #35 item 4) ------------------------------------------------------
TRAIN_IN_A_FRESH_PROCESS = """
import random, sys
from tk.core.text import TextTokenizer, TokenizerConfig
rng = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyzéüßøåçñ"
words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(300)]
lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(600)]  # many tied counts
cfg = TokenizerConfig(kind=sys.argv[1], vocab_size=400, min_frequency=2)
sys.stdout.write(TextTokenizer.train(lines, cfg, ["[PAD]", "[UNK]"]).to_str())
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece", "unigram"])
def test_every_kind_trains_the_same_tokenizer_in_fresh_processes(kind):
    """tokenizers' WordPiece and Unigram trainers follow per-process hash order (issue #1794 there);
    tk's training gives one tokenizer.json for the same texts, byte for byte."""
    import subprocess

    runs = {subprocess.run([sys.executable, "-c", TRAIN_IN_A_FRESH_PROCESS, kind], capture_output=True, text=True,
                           check=True).stdout for _ in range(3)}
    assert len(runs) == 1
    assert json.loads(runs.pop())["model"]["type"] == {"char": "WordLevel", "bpe": "BPE", "wordpiece": "WordPiece",
                                                      "unigram": "Unigram"}[kind]


def test_wordpiece_vocabulary_is_the_tokenizers_trainers_up_to_ties():
    from tokenizers import trainers

    cfg = TokenizerConfig(kind="wordpiece", vocab_size=120, min_frequency=1)
    tk_tok = TextTokenizer.train(TEXTS, cfg, list(BERT_SPECIALS))
    raw, _ = tokenizer_module._subword(cfg, list(BERT_SPECIALS), "[UNK]")
    raw.train_from_iterator([TEXTS], trainers.WordPieceTrainer(vocab_size=120, min_frequency=1,
                                                               special_tokens=list(BERT_SPECIALS), show_progress=False))
    ours, theirs = set(tk_tok.tok.get_vocab()), set(raw.get_vocab())
    assert len(ours) == len(theirs)  # every merge of this small corpus: fewer than 120
    assert len(ours & theirs) >= len(ours) - 4  # the rest: merges of equal count, which tokenizers orders by hash
    assert {"t", "##t", "ü", "##ï", "the", "[UNK]"} <= ours and not any("\U000f0000" <= c for p in ours for c in p)
    assert tk_tok.special_ids == {s: i for i, s in enumerate(BERT_SPECIALS)}
    assert tk_tok.decode(tk_tok.encode("the cat sat on a mat")) == "the cat sat on a mat"


def test_unigram_canonical_form_orders_tied_characters_and_rounds_scores():
    from tokenizers import Tokenizer, models

    from tk.core.text.reproducible import canonical_unigram

    def tok(tail: list[str], noise: float) -> Tokenizer:
        vocab = [("<unk>", 0.0), ("ab", -2.0 + noise), ("a", -3.0), ("b", -3.0 - noise)]
        vocab += [(c, -9.0 + k * 1e-4) for k, c in enumerate(tail)]  # appended in hash order
        return Tokenizer(models.Unigram(vocab, unk_id=0))

    one = canonical_unigram(tok(["z", "x", "y"], 1e-12), ["<unk>"])
    two = canonical_unigram(tok(["y", "z", "x"], -1e-12), ["<unk>"])
    assert one.to_str() == two.to_str()
    vocab = json.loads(one.to_str())["model"]["vocab"]
    assert vocab == [["<unk>", 0.0], ["ab", -2.0], ["a", -3.0], ["b", -3.0], ["x", -8.9998], ["y", -8.9999],
                     ["z", -9.0]]
    assert json.loads(one.to_str())["model"]["unk_id"] == 0


@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece", "unigram"])
def test_a_long_text_encodes_in_pieces_to_the_same_ids(kind):
    """encode_long cuts before single-space-led words and batches the pieces (issue #36 item 3)."""
    from tk.core.text import encode_long

    words = ["the", "cat", "Ünïcode", "naïve", "x1", "--", "ok.", "日本", "a\tb", "\n", "\n\n", "  ", "end"]
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(words, size=6000))
    tok = TextTokenizer.train([text[:20000]], TokenizerConfig(kind=kind, vocab_size=400, min_frequency=1), ["<unk>"])
    assert encode_long(tok, text, piece=500) == tok.encode(text)
    assert encode_long(tok, text[:300], piece=500) == tok.encode(text[:300])
