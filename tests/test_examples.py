"""examples/tk-token-tagging: exact-span entity F1 by hand, and the package installed (its
metadata on sys.path) and trained end to end through `tk run` well above the majority-tag
baselines, then used by `tk predict`; and a start from a BERT folder matches transformers."""

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.plugin_dist import install_metadata
from tk.core.cli import cli
from tk.core.recipe import load_config
from tk.core.step import StepOutput

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tk-token-tagging"


@pytest.fixture(scope="module")
def tagging(tmp_path_factory):
    """The example installed: its dist-info (from pyproject.toml) and its source on sys.path."""
    site = tmp_path_factory.mktemp("site")
    install_metadata(EXAMPLE, site)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))
        mp.syspath_prepend(str(site))
        import tk_token_tagging  # noqa: F401  (imports from the example's source)

        yield site


def test_spans_and_f1_by_hand(tagging):
    from tk_token_tagging.spans import bio_spans, prf, span_counts

    gold = ["B-PER", "I-PER", "O", "B-LOC", "O", "B-ORG", "I-ORG"]
    pred = ["B-PER", "O", "O", "B-LOC", "O", "B-ORG", "I-ORG"]
    assert bio_spans(gold) == [("PER", 0, 2), ("LOC", 3, 4), ("ORG", 5, 7)]
    # conlleval: an I- after O (or after another type) starts an entity; B- always does
    assert bio_spans(["O", "I-LOC", "I-LOC", "I-PER", "B-PER", "I-PER"]) == [("LOC", 1, 3), ("PER", 3, 4),
                                                                            ("PER", 4, 6)]
    # PER cut short is wrong (boundaries must match exactly): 2 of 3 correct each way
    assert span_counts(gold, pred) == (2, 3, 3)
    p, r, f = prf(2, 3, 3)
    assert (p, r) == pytest.approx((2 / 3, 2 / 3)) and f == pytest.approx(2 / 3)
    # 1 correct of 4 predicted, 2 gold: P 1/4, R 1/2, F1 = 2 * (1/8) / (3/4) = 1/3
    assert prf(1, 4, 2)[2] == pytest.approx(1 / 3)
    assert prf(0, 0, 5) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="'X-PER' at position 1 is not BIO"):
        bio_spans(["O", "X-PER"])


def test_entity_f1_metric_skips_non_word_positions(tagging):
    from tk_token_tagging.metrics import EntityF1

    tags = ["O", "B-PER", "I-PER", "B-LOC"]
    metric = EntityF1(tags)
    gold = torch.tensor([[-100, 1, 2, 0, 3, -100], [-100, 3, -100, -100, -100, -100]])  # [CLS] and PAD: -100
    pred_ids = torch.tensor([[3, 1, 2, 0, 0, 0], [0, 3, 0, 0, 0, 0]])  # sentence 1 misses the LOC
    logits = torch.nn.functional.one_hot(pred_ids, len(tags)).float()
    metric.update(StepOutput(loss=torch.tensor(0.0), num_items=1, outputs=logits), {"tags": gold})
    # gold: PER, LOC | LOC ; predicted: PER | LOC -> correct 2, predicted 2, gold 3
    assert metric.compute() == pytest.approx({"entity_precision": 1.0, "entity_recall": 2 / 3, "entity_f1": 0.8})


def test_conll_files_are_read_and_bad_lines_named(tagging, tmp_path):
    from tk_token_tagging.corpus import read_conll

    from tk.core import TkError

    good = tmp_path / "train.txt"
    good.write_text("-DOCSTART- O\n\nanna B-PER\nsilva I-PER\nslept O\n\nhi O\n")
    assert read_conll(good) == [(["anna", "silva", "slept"], ["B-PER", "I-PER", "O"]), (["hi"], ["O"])]
    bad = tmp_path / "bad.txt"
    bad.write_text("anna B-PER\nsilva\n")
    with pytest.raises(TkError, match=r"bad.txt:2: 'silva' has no tag"):
        read_conll(bad)
    with pytest.raises(TkError, match="does not exist"):
        read_conll(tmp_path / "missing.txt")


def majority_tag_baselines(train, val):
    """Entity F1 of (a) the most frequent tag everywhere, (b) each word's most frequent train tag."""
    from tk_token_tagging.spans import prf, span_counts

    overall = Counter(t for _, tags in train for t in tags).most_common(1)[0][0]
    by_word = defaultdict(Counter)
    for words, tags in train:
        for w, t in zip(words, tags):
            by_word[w][t] += 1
    results = []
    for tagger in (lambda w: overall, lambda w: by_word[w].most_common(1)[0][0] if w in by_word else overall):
        counts = [0, 0, 0]
        for words, tags in val:
            counts = [a + b for a, b in zip(counts, span_counts(tags, [tagger(w) for w in words]))]
        results.append(prf(*counts)[2])
    return results


@pytest.mark.slow
def test_trains_end_to_end_well_above_the_majority_tag_baselines(tagging, tmp_path):
    overrides = ["data.num_train=1000", "data.num_val=200", "train.max_steps=120", "train.eval_every=120",
                 "train.progress=false", "train.device=cpu", "schedule.warmup_steps=10"]
    cfg, task_cls = load_config("token_tagging_synthetic", overrides)
    task = task_cls(cfg)
    overall_f1, word_f1 = majority_tag_baselines(task.sentences("train"), task.sentences("val"))
    assert overall_f1 == 0.0  # "O" everywhere finds no entity
    assert 0.5 < word_f1 < 0.85  # context decides the ambiguous words

    run_dir = tmp_path / "run"
    run = CliRunner().invoke(cli, ["run", "token_tagging_synthetic", f"output_dir={run_dir}", *overrides])
    assert run.exit_code == 0, run.output + run.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    f1 = [r["val/entity_f1"] for r in rows if "val/entity_f1" in r][-1]
    assert f1 > 0.93 and f1 > word_f1 + 0.12, (f1, word_f1)

    # tk predict on raw val sentences agrees with their gold entities as often as the F1 says
    from tk_token_tagging.spans import bio_spans

    val = task.sentences("val")[:30]
    pred = CliRunner().invoke(cli, ["predict", str(run_dir), "-"], input="\n".join(" ".join(w) for w, _ in val))
    assert pred.exit_code == 0, pred.output + pred.stderr
    records = [json.loads(line) for line in pred.output.splitlines()]
    assert len(records) == len(val)
    exact = sum([(e["type"], e["start"], e["end"]) for e in r["entities"]] == bio_spans(tags)
                for r, (_, tags) in zip(records, val))
    assert exact >= 0.8 * len(val), (exact, f1)


@pytest.mark.slow
def test_start_from_a_bert_folder_matches_transformers(tagging, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tk_token_tagging.corpus import generate

    words = sorted({w for ws, _ in generate(200, 0) for w in ws})
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    hf = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64), add_pooling_layer=False).eval()
    hf.save_pretrained(folder)

    overrides = [f"model.pretrained_dir={folder}", "data.num_train=64", "data.num_val=32", "train.device=cpu"]
    cfg, task_cls = load_config("token_tagging_synthetic", overrides)
    task = task_cls(cfg)
    task.setup()
    model = task.build_model().eval()
    task.init_pretrained(model)
    item = task.encode(["anna", "silva", "flew", "to", "oslo"], ["B-PER", "I-PER", "O", "O", "B-LOC"])
    assert item["tags"][0] == -100 and item["tags"][-1] == -100  # [CLS] and [SEP] are not tagged
    reference = transformers.BertTokenizerFast(str(folder / "vocab.txt"))
    sentence = ["Anna", "silva", "flew", "to", "oslo", "zzq"]  # casing and an unknown word, as BERT tokenizes them
    assert task.encode(sentence)["input_ids"] == reference(sentence, is_split_into_words=True)["input_ids"]
    ids = torch.tensor([item["input_ids"]])
    with torch.no_grad():
        ours = model.encoder(ids)
        theirs = hf(input_ids=ids).last_hidden_state
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)

    run = CliRunner().invoke(cli, ["run", "token_tagging_synthetic", f"output_dir={tmp_path / 'run'}", *overrides,
                                   "train.max_steps=2", "train.eval_every=2", "train.progress=false"])
    assert run.exit_code == 0, run.output + run.stderr
