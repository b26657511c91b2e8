"""`tk predict`: inputs from arguments, stdin and files; overrides told from inputs; batched,
streamed JSON lines; a bad input gets an error field without costing the others."""

import io
import json

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.engine.predict import format_record, predict_batches, read_inputs, split_overrides
from tk.core.errors import TkError
from tk.plugins.image_classification.synthetic import SyntheticShapes


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


# -- the generic engine ---------------------------------------------------------------
class LengthTask:
    """Predicts the length of text inputs; an input "bad" makes the whole batch raise."""

    def __init__(self):
        self.calls = []

    def predict(self, model, inputs):
        self.calls.append(list(inputs))
        if "bad" in inputs:
            raise ValueError("unusable input")
        return [{"length": len(s)} for s in inputs]


def test_split_overrides_by_the_run_sections():
    args = ["predict.top_k=3", "a=b.png", "x.y=1", "cat.png", "train.device=cpu", "data.root.png"]
    overrides, inputs = split_overrides(args, ["data", "predict", "train"])
    assert overrides == ["predict.top_k=3", "train.device=cpu"]
    assert inputs == ["a=b.png", "x.y=1", "cat.png", "data.root.png"]


def test_read_inputs_in_order_lazily():
    stdin = io.StringIO("s1\n\n  \ns2\r\n")
    file = io.StringIO("f1\nf2")
    assert list(read_inputs(["a", "-", "b"], stdin, file)) == ["a", "s1", "s2", "b", "f1", "f2"]


def test_inputs_that_are_not_utf8_are_one_error_naming_the_line():
    from tk.core.errors import TkError

    good = io.BytesIO("héllo\nwörld\n".encode())
    assert list(read_inputs(["-"], good)) == ["héllo", "wörld"]
    for stream, name in ((io.BytesIO(b"ok\n\xff\xfe\n"), "standard input"),
                         (io.TextIOWrapper(io.BytesIO(b"ok\n\xff\xfe\n"), errors="surrogateescape"),
                          "standard input")):
        with pytest.raises(TkError, match=rf"^{name} line 2: not valid UTF-8"):
            list(read_inputs(["-"], stream))


def test_batches_stream_and_a_bad_input_is_isolated():
    task, pulled = LengthTask(), []

    def source():
        for s in ["a", "bb", "bad", "dddd", "eeeee"]:
            pulled.append(s)
            yield s

    records = predict_batches(task, None, source(), batch_size=2)
    assert next(records) == {"input": "a", "length": 1} and pulled == ["a", "bb"]  # first batch before the rest
    rest = list(records)
    assert rest == [{"input": "bb", "length": 2}, {"input": "bad", "error": "bad: unusable input"},
                    {"input": "dddd", "length": 4}, {"input": "eeeee", "length": 5}]
    # the failing batch is retried one input at a time; the other batches run whole
    assert task.calls == [["a", "bb"], ["bad", "dddd"], ["bad"], ["dddd"], ["eeeee"]]


def test_predict_breaking_its_contract_is_a_clear_error():
    class Short:
        def predict(self, model, inputs):
            return [{}]

    with pytest.raises(TkError, match="returned 1 results for 2 inputs"):
        list(predict_batches(Short(), None, ["a", "b"]))


def test_text_format():
    top = {"input": "cat.png", "top_k": [{"label": "cat", "prob": 0.912}, {"label": "dog", "prob": 0.05}]}
    assert format_record(top, "text") == "cat.png: cat 0.912, dog 0.050"
    assert format_record({"input": "x", "error": "x: gone"}, "text") == "x: error: x: gone"
    assert format_record({"input": "hi", "translation": "salut", "score": -0.5}, "text") == \
        "hi: translation=salut  score=-0.5"
    assert json.loads(format_record(top)) == top


# -- end to end on a tiny image run -----------------------------------------------------
@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A 2-update image_classification run (tiny ViT) and 3 images to predict."""
    root = tmp_path_factory.mktemp("predict")
    run_dir = root / "run"
    result = invoke("run", "quickstart", f"output_dir={run_dir}", "train.max_steps=2", "train.batch_size=8",
                    "train.eval_batch_size=8", "train.eval_every=2", "train.progress=false", "train.device=cpu",
                    "data.num_train=16", "data.num_val=8", "model.dim=32", "model.depth=1", "model.num_heads=2")
    assert result.exit_code == 0, result.output
    paths = []
    for i in range(3):
        img, _ = SyntheticShapes(3, split="test", seed=7)[i]
        img.save(root / f"img{i}.png")
        paths.append(str(root / f"img{i}.png"))
    return run_dir, paths


def expected_probs(run_dir, path):
    task, model = load_run(run_dir, "best")
    with torch.no_grad():
        x = task._transform(False)(Image.open(path).convert("RGB"))[None]  # (1, 3, H, W)
        probs = model(x).softmax(-1)[0]  # (C,)
    values, indices = probs.sort(descending=True)
    return [(task.class_names[i], v) for i, v in zip(indices.tolist(), values.tolist())]


def test_predict_stdin_with_an_override_prints_json_lines(image_run):
    run_dir, paths = image_run
    result = invoke("predict", run_dir, "-", "predict.top_k=2", "--batch-size", "2", "--device", "cpu",
                    input="\n".join(paths) + "\n")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["input"] for r in records] == paths
    for record, path in zip(records, paths):
        assert [c["label"] for c in record["top_k"]] == [label for label, _ in expected_probs(run_dir, path)[:2]]
        want = [p for _, p in expected_probs(run_dir, path)[:2]]
        assert [c["prob"] for c in record["top_k"]] == pytest.approx(want, abs=1e-5)
    default = invoke("predict", run_dir, paths[0], "--device", "cpu")
    assert default.exit_code == 0 and len(json.loads(default.stdout)["top_k"]) == 5  # predict.top_k default


def test_a_bad_input_gets_an_error_line_and_exit_1(image_run, tmp_path):
    run_dir, paths = image_run
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    listing = tmp_path / "inputs.txt"
    listing.write_text(f"{paths[0]}\n{not_image}\n{tmp_path / 'missing.png'}\n{paths[1]}\n")
    result = invoke("predict", run_dir, "--input-file", listing, "--device", "cpu")
    assert result.exit_code == 1
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["input"] for r in records] == [paths[0], str(not_image), str(tmp_path / "missing.png"), paths[1]]
    assert "top_k" in records[0] and "top_k" in records[3]
    for bad in records[1:3]:
        assert set(bad) == {"input", "error"} and "\n" not in bad["error"]
        assert bad["error"].startswith(f"cannot read image {bad['input']}: ")
    assert "No such file" in records[2]["error"]
    assert result.stderr == "error: 2 of 4 inputs failed (see their error fields)\n"


def test_text_format_and_config_errors(image_run):
    run_dir, paths = image_run
    text = invoke("predict", run_dir, paths[0], "predict.top_k=1", "--format", "text", "--device", "cpu")
    assert text.exit_code == 0, text.output
    label, prob = expected_probs(run_dir, paths[0])[0]
    assert text.stdout == f"{paths[0]}: {label} {prob:.3f}\n"
    zero = invoke("predict", run_dir, paths[0], "predict.top_k=0")
    assert zero.exit_code == 2 and "predict.top_k must be >= 1, got 0" in zero.stderr
    typo = invoke("predict", run_dir, paths[0], "predict.topk=3")
    assert typo.exit_code == 2 and "did you mean 'top_k'" in typo.stderr
    none = invoke("predict", run_dir)
    assert none.exit_code == 2 and "no inputs" in none.stderr


def test_jsonl_rows_go_only_to_a_task_that_reads_rows(tmp_path):
    """A .jsonl input's lines are rows (dicts): a task whose predict takes text refuses them in one line."""
    from tk.core.engine.predict import _predict_batch
    from tk.core.errors import TkError

    class TextTask:
        name = "text_only"

        def predict(self, model, inputs):
            return [{"out": " ".join(inputs)}]

    import contextlib

    with pytest.raises(TkError, match="'text_only' predicts from text; the rows of a .jsonl input"):
        _predict_batch(TextTask(), None, [{"prompt": "hi"}], contextlib.nullcontext)
    assert _predict_batch(TextTask(), None, ["hi"], contextlib.nullcontext)[0]["out"] == "hi"
