"""text_classification with data.streaming (issue #36 item 2): a split's rows read in order
from its file (or a streamed datasets split), encoded as the in-memory path encodes them, and
a SIGKILLed streamed run that resumes with every logged loss equal to an uninterrupted run's,
on 1 and 2 processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tk.core.data import LoaderSpec, build_loader
from tk.core.engine.inference import load_run
from tk.core.errors import TkError
from tk.plugins.text_classification.synthetic import synthetic_rows

from ..kill import kill_when
from .test_text_classification import SMALL_RUN, run_cli, write_tsv

TK = str(Path(sys.executable).with_name("tk"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("textstream")
    return {"train": write_tsv(root / "train.tsv", synthetic_rows(160, 0)),
            "val": write_tsv(root / "val.tsv", synthetic_rows(40, 1))}


def args(files: dict[str, Path], *extra: str) -> list[str]:
    return ["textcls_synthetic", *SMALL_RUN, "data.source=files", f"data.train_file={files['train']}",
            f"data.val_file={files['val']}", "data.text_column=sentence", "train.batch_size=8",
            "train.eval_batch_size=16", "train.log_every=1", "train.eval_every=10", *extra]


@pytest.mark.slow
def test_a_streamed_split_encodes_as_the_in_memory_split_and_trains_the_same_first_pass(files, tmp_path):
    """Evaluation order is the file's: the streamed val batches are the in-memory ones; the
    label set and tokenizer come from one pass over the stream; a val row with an unseen
    label is the same one-line error."""
    common = args(files, "train.max_steps=2", "train.eval_every=2")
    run_cli(["run", *common, f"output_dir={tmp_path / 'plain'}"])
    run_cli(["run", *common, "data.streaming=true", f"output_dir={tmp_path / 'streamed'}"])
    plain, _ = load_run(tmp_path / "plain")
    streamed, _ = load_run(tmp_path / "streamed")
    assert streamed.labels == plain.labels and streamed.tokenizer.to_str() == plain.tokenizer.to_str()
    spec = LoaderSpec(batch_size=16)
    a = list(build_loader(plain.build_dataset("val"), spec, plain.collate))
    b = list(build_loader(streamed.build_dataset("val"), spec, streamed.collate))
    assert len(a) == len(b) == 3 and all(x[k].equal(y[k]) for x, y in zip(a, b) for k in x)
    write_tsv(tmp_path / "odd.tsv", [("good film", "positive"), ("a film", "maybe")])
    streamed.data.val_file = str(tmp_path / "odd.tsv")
    with pytest.raises(TkError, match=r"odd.tsv:3: label 'maybe' is not among the train split's labels"):
        list(build_loader(streamed.build_dataset("val"), spec, streamed.collate))


def records(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val/loss")) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("procs, workers", [(1, 2), (2, 0)])
def test_a_sigkilled_streamed_text_run_resumes_exactly(files, tmp_path, procs, workers):
    common = args(files, "data.streaming=true", "data.shuffle_buffer=24", "train.max_steps=30",
                  f"train.num_workers={workers}", "train.deterministic=true")
    launch = [] if procs == 1 else ["--nproc-per-node", str(procs)]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    done = subprocess.run([TK, "run", *common, f"output_dir={ref}", *launch], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kill_when([TK, "run", *common, f"output_dir={killed}", "train.save_every=1", *launch],
              killed / "checkpoints" / "step_00000006.pt")
    resumed = subprocess.run([TK, "run", *common, f"output_dir={killed}", "--resume", *launch],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert records(killed) == records(ref) and len(records(ref)) >= 30


def test_a_hub_split_streams_through_the_datasets_builder(tmp_path, monkeypatch):
    from tk.core.text import BERT_SPECIALS, BERT_TEMPLATE, TextTokenizer, TokenizerConfig
    from tk.plugins.text_classification.data import DataConfig
    from tk.plugins.text_classification.stream import row_stream

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "t.csv").write_text("sentence,label\ngood film,pos\nbad film,neg\nfine film,pos\n")
    d = DataConfig(source="hf", hf_name="csv", hf_data_files={"train": str(tmp_path / "t.csv")}, streaming=True,
                   text_column="sentence")
    tok = TextTokenizer.train(["good bad fine film"], TokenizerConfig(kind="char", vocab_size=40),
                              BERT_SPECIALS, BERT_TEMPLATE)
    ds = row_stream(d, "train", tok, ["neg", "pos"], 16, distilling=False)
    build_loader(ds, LoaderSpec(batch_size=2))
    assert len(ds) == 3 and [x["labels"] for x in ds] == [1, 0, 1]
    with pytest.raises(TkError, match="data.streaming: distillation caches"):
        row_stream(d, "train", tok, ["neg", "pos"], 16, distilling=True)


def test_streaming_the_synthetic_corpus_is_refused_by_validate():
    from click.testing import CliRunner

    from tk.core.cli import cli

    result = CliRunner().invoke(cli, ["validate", "textcls_synthetic", "data.streaming=true"])
    assert result.exit_code == 2 and "data.streaming is for data.source 'files' or 'hf'" in result.stderr


# -- translation: streamed train pairs ---------------------------------------------------------
@pytest.fixture(scope="module")
def parallel(tmp_path_factory) -> dict[str, str]:
    from tk.plugins.translation.synthetic import reverse_pairs

    root = tmp_path_factory.mktemp("parallel")
    for split, n, seed in (("train", 200, 0), ("val", 20, 1)):
        pairs = reverse_pairs(n, seed=seed)
        (root / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs))
        (root / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs))
    return {"train": str(root / "train"), "val": str(root / "val")}


def translation_args(parallel: dict[str, str], *extra: str) -> list[str]:
    return ["translation_reverse", "data.source=files", f"data.train_prefix={parallel['train']}",
            f"data.val_prefix={parallel['val']}", "data.max_len=24", "data.max_tokens=256", "tokenizer.vocab_size=320",
            "model.dim=32", "model.depth=1", "model.num_heads=2", "model.max_len=64", "train.batch_size=8",
            "train.log_every=1", "train.eval_every=10", "decode.bleu_every=0", "train.best_metric=val/loss",
            "train.progress=false", *extra]


def test_streamed_train_pairs_are_the_in_memory_pairs_and_misaligned_files_fail(parallel, tmp_path):
    from tk.core.recipe import load_config
    from tk.core.text import iter_parallel

    cfg, task_cls = load_config(translation_args(parallel)[0], translation_args(parallel, "data.streaming=true")[1:])
    task = task_cls(cfg, None)
    task.setup()
    stream = task.build_loader("train", LoaderSpec(batch_size=8)).dataset
    memory = task.build_dataset("train")
    items = list(stream)
    assert len(items) == len(memory) == 200
    assert all(a["src"].tolist() == memory.src[i] and a["tgt"].tolist() == memory.tgt[i] for i, a in enumerate(items))
    (tmp_path / "m.en").write_text("a\nb\nc\n")
    (tmp_path / "m.de").write_text("a\nb\n")
    with pytest.raises(TkError, match=r"misaligned parallel files: .*m.en has more than 2 lines but .*m.de has 2"):
        list(iter_parallel(tmp_path / "m.en", tmp_path / "m.de"))
    with pytest.raises(TkError, match=r"misaligned parallel files: .*m.de has 2 lines but .*m.en has 3"):
        list(iter_parallel(tmp_path / "m.de", tmp_path / "m.en"))


@pytest.mark.slow
@pytest.mark.parametrize("procs, workers", [(1, 2), (2, 0)])
def test_a_sigkilled_streamed_translation_run_resumes_exactly(parallel, tmp_path, procs, workers):
    common = translation_args(parallel, "data.streaming=true", "data.shuffle_buffer=32", "train.max_steps=30",
                              f"train.num_workers={workers}", "train.deterministic=true")
    launch = [] if procs == 1 else ["--nproc-per-node", str(procs)]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    done = subprocess.run([TK, "run", *common, f"output_dir={ref}", *launch], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kill_when([TK, "run", *common, f"output_dir={killed}", "train.save_every=1", *launch],
              killed / "checkpoints" / "step_00000006.pt")
    resumed = subprocess.run([TK, "run", *common, f"output_dir={killed}", "--resume", *launch],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert records(killed) == records(ref) and len(records(ref)) >= 30
