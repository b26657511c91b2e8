"""tk.core.testing, the checks plugin authors call: each one passes on built-in tasks at toy
size and on a correct toy task, and fails, naming the fault, on a task with that fault: a NaN
loss, a parameter the loss never uses, padding counted as items, a per-batch mean, a generator
of the task's own, data not sharded across processes, predictions reordered, a model
torch.export cannot trace, an export_hf hook that crashes. docs/plugins.md's example test file
runs on the guide's plugin."""

import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tk.core import testing

from ..conftest import TOY_PLUGIN, make_distribution
from ..test_guide import install_guide_plugin

BROKEN = textwrap.dedent('''

    import dataclasses

    import numpy as np

    from tk.core.data.loader import build_loader


    class Blobs(ToyTask):
        """Blobs with predict and example_inputs (tk.core.testing's tests)."""

        name = "tt_blobs"

        def predict(self, model, inputs):
            x = torch.tensor([[float(v) for v in text.split(",")] for text in inputs])
            return [{"label": int(p.argmax()), "probs": p.tolist()} for p in model(x).softmax(-1)]

        def example_inputs(self, model):
            return {"input": torch.randn(2, self.data.dim)}


    class Tokens(ToyTokenTask):
        """Token tagging, a correct token-level loss."""

        name = "tt_tokens"


    class NanLoss(ToyTask):
        """Bug: log of a probability that underflowed to 0, times 0: NaN."""

        name = "tt_nan_loss"

        def loss(self, model, batch):
            out = super().loss(model, batch)
            return StepOutput(loss=out.loss + torch.log(torch.zeros(())) * 0, num_items=out.num_items)


    class WithSpare(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.spare = inner, nn.Linear(4, 4)  # built, never called

        def forward(self, input):
            return self.inner(input)


    class SpareHead(Blobs):
        """Bug: a trainable layer the loss never uses (DDP fails on it)."""

        name = "tt_spare_head"

        def build_model(self):
            return WithSpare(super().build_model())


    class PadItems(ToyTokenTask):
        """Bug: num_items counts the padding positions too."""

        name = "tt_pad_items"

        def loss(self, model, batch):
            out = super().loss(model, batch)
            return StepOutput(loss=out.loss, num_items=batch["labels"].numel())


    class MicroMean(ToyTokenTask):
        """Bug: the batch's mean token loss taken as every sequence's loss."""

        name = "tt_micro_mean"

        def loss(self, model, batch):
            out = super().loss(model, batch)
            rows = batch["labels"].shape[0]
            return StepOutput(loss=out.loss / out.num_items * rows, num_items=rows)


    class OwnRng(ToyTokenTask):
        """Bug: masks inputs with a generator of its own, which a resume starts again."""

        name = "tt_own_rng"

        def setup(self, resume=False):
            self.rng = np.random.default_rng(0)

        def transform_batch(self, batch, training):
            if training:
                drop = torch.from_numpy(self.rng.random(tuple(batch["src"].shape)) < 0.2)
                batch = {**batch, "src": batch["src"].masked_fill(drop, 0)}
            return batch


    class Unsharded(ToyTokenTask):
        """Bug: a custom loader that drops LoaderSpec's rank and world size."""

        name = "tt_unsharded"

        def build_loader(self, split, spec):
            one = dataclasses.replace(spec, rank=0, world_size=1)
            return build_loader(self.build_dataset(split), one, collate_fn=self.collate)


    class Unordered(Blobs):
        """Bug: predicts the inputs sorted by length (for speed) and never restores their order."""

        name = "tt_unordered"

        def predict(self, model, inputs):
            return super().predict(model, sorted(inputs, key=len))


    class Branchy(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input):
            out = self.inner(input)
            return out if out.sum() > 0 else -out  # data-dependent control flow


    class Untraceable(Blobs):
        """Bug: example_inputs promises a graph, but the model branches on its data."""

        name = "tt_untraceable"

        def build_model(self):
            return Branchy(super().build_model())


    class CrashingHf(Blobs):
        """Bug: an export_hf hook that fails with a KeyError instead of a TkError."""

        name = "tt_crashing_hf"

        def export_hf(self, model):
            return {"architectures": ["Blobs"]}, {"weight": model.state_dict()["classifier.weight"]}
''')
TASKS = {"tt_blobs": "Blobs", "tt_tokens": "Tokens", "tt_nan_loss": "NanLoss", "tt_spare_head": "SpareHead",
         "tt_pad_items": "PadItems", "tt_micro_mean": "MicroMean", "tt_own_rng": "OwnRng", "tt_unsharded": "Unsharded",
         "tt_unordered": "Unordered", "tt_untraceable": "Untraceable", "tt_crashing_hf": "CrashingHf"}
SEQUENCES = {"tt_tokens", "tt_pad_items", "tt_micro_mean", "tt_own_rng", "tt_unsharded"}  # toy_tokens' subclasses
TINY = ["train.device=cpu", "train.batch_size=8", "train.eval_every=3", "optim.lr=0.01"]
TEXTCLS = ["data.num_train=64", "data.num_val=16", "tokenizer.vocab_size=100", "model.dim=32", "model.depth=1",
           "train.batch_size=8", "train.eval_batch_size=16", "train.eval_every=2", "train.device=cpu"]
NO_DROPOUT = ["model.dropout=0", "model.head_dropout=0"]
LM = ["data.num_sentences=300", "data.eval_blocks=4", "model.dim=32", "model.depth=1", "train.batch_size=4",
      "train.eval_every=2", "train.device=cpu"]
INPUTS = ["1,2,3,4,5,6,7,8", "-0.5,0,0.5,1,-1,2,0,0", "9,8,7,6,5,4,3,2.25"]


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    """The toy tasks (conftest's, plus the ones above) installed in a site on sys.path; name -> recipe."""
    root = tmp_path_factory.mktemp("toys")
    site = make_distribution(root / "site", "tk-testing-toys", "tk_testing_toys", TOY_PLUGIN + BROKEN,
                             {name: f"tk_testing_toys:{cls}" for name, cls in TASKS.items()})
    sys.path.insert(0, str(site))
    recipes = {}
    for name in TASKS:
        data = "{num_train: 64, num_val: 16" + (", max_len: 12}" if name in SEQUENCES else "}")
        recipes[name] = root / f"{name}.yaml"
        recipes[name].write_text(f"task: {name}\ndata: {data}\nmodel: {{hidden: 16}}\n")
    yield recipes
    sys.path.remove(str(site))


@pytest.fixture(scope="module")
def textcls_run(tmp_path_factory):
    """A finished textcls_synthetic run of 4 updates (check_resume's uninterrupted run); with BERT's
    pooler and post-norm, so that it exports to transformers (BERT)."""
    overrides = [*TEXTCLS, "model.pooler=true", "model.norm_first=false"]
    found = testing.check_resume("textcls_synthetic", tmp_path_factory.mktemp("textcls"), overrides, steps=4)
    return found["reference"]


# -- check_step ---------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,overrides", [("textcls_synthetic", TEXTCLS), ("lm_synthetic", LM)])
def test_check_step_passes_built_in_tasks(recipe, overrides, tmp_path):
    found = testing.check_step(recipe, overrides, tmp_path)
    assert found["num_items"] > 0 and found["parameters"] > 0


def test_check_step_catches_a_nan_loss_and_an_unused_parameter(toys, tmp_path):
    testing.check_step(toys["tt_blobs"], TINY, tmp_path / "ok")
    with pytest.raises(AssertionError, match=r"NanLoss.loss: the loss of a training batch is nan"):
        testing.check_step(toys["tt_nan_loss"], TINY, tmp_path / "nan")
    with pytest.raises(AssertionError, match=r"SpareHead.loss: 2 trainable parameters get no gradient \(spare.weight, "
                                             r"spare.bias\); DDP .* fails on unused parameters"):
        testing.check_step(toys["tt_spare_head"], TINY, tmp_path / "spare")


# -- check_accumulation -------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,overrides", [("textcls_synthetic", TEXTCLS + NO_DROPOUT), ("lm_synthetic", LM)])
def test_check_accumulation_passes_built_in_tasks(recipe, overrides, tmp_path):
    found = testing.check_accumulation(recipe, tmp_path, overrides)
    assert len(found["losses"]) == 3 and found["max_grad_gap"] < 1e-5


def test_check_accumulation_catches_padding_counted_and_per_batch_means(toys, tmp_path):
    found = testing.check_accumulation(toys["tt_tokens"], tmp_path / "ok", TINY, accum=4)
    assert found["max_grad_gap"] < 1e-5
    with pytest.raises(AssertionError, match=r"update 1 counts \d+ vs \d+ items: num_items must not count padding"):
        testing.check_accumulation(toys["tt_pad_items"], tmp_path / "pad", TINY, accum=4)
    with pytest.raises(AssertionError, match=r"the loss of update 1 is .* \(difference .*allowed 0.0001 relative\)"):
        testing.check_accumulation(toys["tt_micro_mean"], tmp_path / "mean", TINY, accum=4)


def test_check_accumulation_names_the_dropout_that_breaks_it(tmp_path):
    with pytest.raises(AssertionError, match=r"the model has dropout .*turn it off with an override"):
        testing.check_accumulation("textcls_synthetic", tmp_path, TEXTCLS)


# -- check_resume ----------------------------------------------------------------------------
def test_check_resume_passes_a_built_in_task_with_dropout(textcls_run):
    records = [json.loads(line) for line in (textcls_run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records][-2:] == [(4, "train"), (4, "val")]


def test_check_resume_catches_randomness_outside_the_engines_rng(toys, tmp_path):
    found = testing.check_resume(toys["tt_tokens"], tmp_path / "ok", [*TINY, "data.mask_prob=0.2"])
    assert found["stopped_at"] == 3
    with pytest.raises(AssertionError, match=r"stopped after update 3 and resumed vs one run of 6 updates: step 4 "
                                             r"\(train\) logged loss="):
        testing.check_resume(toys["tt_own_rng"], tmp_path / "own_rng", TINY)


# -- check_two_processes --------------------------------------------------------------------------
@pytest.mark.slow
def test_check_two_processes_passes_a_built_in_task_and_catches_unsharded_data(toys, tmp_path):
    small = ["train.max_steps=2", "train.eval_every=2", "train.batch_size=4"]
    testing.check_two_processes("textcls_synthetic", tmp_path / "textcls", TEXTCLS + NO_DROPOUT + small)
    with pytest.raises(AssertionError, match=r"2 processes x batch_size 4 x grad_accum 1 vs 1 process x batch_size 8: "
                                             r"step \d+ \(train\) logged loss="):
        testing.check_two_processes(toys["tt_unsharded"], tmp_path / "unsharded", TINY + small)


# -- check_predict, check_export -------------------------------------------------------------------
def test_check_predict_and_export_pass_a_built_in_task(textcls_run, tmp_path):
    rows = testing.check_predict(textcls_run, ["good , not bad", "bad", "not good at all , bad"])
    assert [set(r) for r in rows] == [{"input", "label", "probs"}] * 3
    report = testing.check_export(textcls_run, tmp_path)
    assert {k: v.split(":")[0] for k, v in report.items()} == {
        "safetensors": "written", "torch-export": "written", "onnx": "written", "hf": "written",
        "timm": "refused", "peft": "refused"}


def test_check_predict_and_export_catch_reordering_untraceable_models_and_crashes(toys, tmp_path):
    args = [*TINY, "train.max_steps=2", "train.eval_every=2"]
    blobs = testing.train_run(toys["tt_blobs"], tmp_path / "blobs", args)
    assert len(testing.check_predict(blobs, INPUTS)) == 3
    report = testing.check_export(blobs, tmp_path / "blobs_export", formats=("safetensors", "torch-export", "hf"))
    assert report["safetensors"] == report["torch-export"] == "written"
    assert report["hf"].startswith("refused: --format hf: task 'tt_blobs' has a Sequential")

    unordered = testing.train_run(toys["tt_unordered"], tmp_path / "unordered", args)
    with pytest.raises(AssertionError, match=r"input 1 \('-0.5,0,0.5,1,-1,2,0,0'\): tk predict \(alone in its batch\) "
                                             r"gave .*, Unordered.predict on all 3 inputs gave"):
        testing.check_predict(unordered, INPUTS)
    untraceable = testing.train_run(toys["tt_untraceable"], tmp_path / "untraceable", args)
    with pytest.raises(AssertionError, match=r"--format torch-export` exited 2: error: torch.export could not trace.*"
                                             r"\(the task expresses this format\)"):
        testing.check_export(untraceable, tmp_path / "untraceable_export", formats=("torch-export",))
    crashing = testing.train_run(toys["tt_crashing_hf"], tmp_path / "crashing", args)
    with pytest.raises(AssertionError, match=r"--format hf` exited 1: error: KeyError"):
        testing.check_export(crashing, tmp_path / "crashing_export", formats=("hf",))


# -- the docs' example ------------------------------------------------------------------------------
def test_the_docs_example_passes_on_the_guides_plugin(tmp_path, monkeypatch):
    """docs/plugins.md's test file for the guide's `repeats` plugin, run (but its slow test)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"^```python\n(# tests/test_repeats_promises.py\n.*?)^```", doc, re.DOTALL | re.M)
    install_guide_plugin(tmp_path, monkeypatch)
    for name in [m for m in sys.modules if m.split(".")[0] == "tk_repeats"]:  # another test's copy
        monkeypatch.delitem(sys.modules, name)
    namespace = {}
    exec(compile(example, "test_repeats_promises.py", "exec"), namespace)
    tests = {name: fn for name, fn in namespace.items() if name.startswith("test_")}
    assert len(tests) == 4
    for name, fn in tests.items():
        if not any(mark.name == "slow" for mark in getattr(fn, "pytestmark", [])):
            fn(*[tmp_path / name] * len(inspect.signature(fn).parameters))
