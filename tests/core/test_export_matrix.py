"""Every (task, format) pair of ``tk export``, plain and with LoRA: a supported pair loads in
its own library (transformers, timm, torch.export, onnxruntime; safetensors into the model
built without ``model.lora``) and computes tk's logits to 1e-5 with the same predictions; a
refused pair is one line naming why, and writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from tk.core.cli.main import cli
from tk.core.engine.inference import load_run

FAST = ["train.progress=false", "train.num_workers=0", "train.max_steps=3", "train.eval_every=3"]
LORA = ["model.lora.rank=4", "optim.lr=0.01"]
TASKS = {  # recipe and tiny shape; text encoders post-norm (BERT's shape), so hf is supported
    "image_classification": ("quickstart", ["data.num_train=32", "data.num_val=8", "model.dim=32", "model.depth=1",
                                            "model.num_heads=2", "train.batch_size=8", "train.eval_batch_size=8"]),
    "text_classification": ("textcls_synthetic", ["data.num_train=64", "data.num_val=16", "model.dim=32",
                                                  "model.depth=1", "tokenizer.vocab_size=100", "model.norm_first=false"]),
    "language_model": ("lm_synthetic", ["data.num_sentences=300", "data.eval_blocks=2", "model.dim=32",
                                        "model.depth=1", "data.num_samples=0"]),
    "mlm": ("mlm_synthetic", ["data.num_sentences=300", "model.dim=32", "model.depth=1", "tokenizer.vocab_size=100",
                              "model.norm_first=false"]),
    "translation": ("translation_synthetic", ["data.source=reverse", "data.num_train=100", "data.num_val=10",
                                              "data.max_len=24", "data.max_tokens=256", "tokenizer.vocab_size=320",
                                              "model.dim=32", "model.depth=1", "model.num_heads=2", "model.max_len=64"]),
}
SUPPORTED = {
    "image_classification": {"safetensors", "timm", "torch-export", "onnx"},
    "text_classification": {"safetensors", "hf", "torch-export", "onnx"},
    "language_model": {"safetensors", "hf", "torch-export", "onnx"},
    "mlm": {"safetensors", "hf"},
    "translation": {"safetensors"},
}
FORMATS = ("safetensors", "hf", "timm", "torch-export", "onnx")
REFUSED = {  # (task, format) -> what the one line says
    **{(t, "timm"): "only image classifiers (the core ViT or model.timm) export to timm"
       for t in SUPPORTED if t != "image_classification"},
    ("image_classification", "hf"): "has no transformers export",
    ("translation", "hf"): "trained from scratch with tk's tokenizer",  # Marian/NLLB runs export: test_pretrained_translation
    **{(t, f): "gives no example inputs" for t in ("mlm", "translation") for f in ("torch-export", "onnx")},
}
PAIRS = [(t, f) for t in TASKS for f in FORMATS]
assert {p for p in PAIRS if p[1] not in SUPPORTED[p[0]]} == set(REFUSED)  # the matrix is complete


def tk(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One tiny run per (task, lora), made on first use."""
    made: dict[tuple[str, bool], object] = {}
    root = tmp_path_factory.mktemp("matrix")

    def get(task: str, lora: bool):
        if (task, lora) not in made:
            recipe, shape = TASKS[task]
            out = root / f"{task}{'_lora' * lora}"
            result = tk("run", recipe, f"output_dir={out}", *FAST, *shape, *(LORA if lora else []))
            assert result.exit_code == 0, result.output
            made[task, lora] = out
        return made[task, lora]

    return get


def _inputs(task_name: str, task, model) -> dict[str, torch.Tensor]:
    if hasattr(task, "example_inputs"):
        inputs = task.example_inputs(model)
        if inputs:
            return inputs
    gen = torch.Generator().manual_seed(0)
    if task_name == "mlm":  # no example_inputs hook: random ids past the special tokens
        return {"input_ids": torch.randint(5, model.encoder.tok_embed.num_embeddings, (2, 9), generator=gen)}
    vocab = model.src_embed.weight.shape[0]  # translation: an encoder-decoder
    return {"src": torch.randint(4, vocab, (2, 7), generator=gen), "tgt": torch.randint(4, vocab, (2, 5), generator=gen)}


def _load(task_name: str, fmt: str, out, run, lora: bool, task):
    """The export, loaded by its own library: a callable from the inputs to logits."""
    if fmt == "safetensors":  # the model built without model.lora loads the file strictly
        _, plain = load_run(run, overrides=["model.lora=null"] if lora else [], weights=str(out / "model.safetensors"))
        return lambda inputs: plain(**inputs)
    if fmt == "hf":
        transformers = pytest.importorskip("transformers")
        auto = {"text_classification": transformers.AutoModelForSequenceClassification,
                "language_model": transformers.AutoModelForCausalLM, "mlm": transformers.AutoModelForMaskedLM}
        net = auto[task_name].from_pretrained(out).eval()
        if task_name == "language_model":
            return lambda inputs: net(input_ids=inputs["tokens"]).logits
        return lambda inputs: net(input_ids=inputs["input_ids"],
                                  attention_mask=(inputs["input_ids"] != task.pad_id).long()).logits
    if fmt == "timm":
        timm = pytest.importorskip("timm")
        net = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
        return lambda inputs: net(inputs["x"])
    if fmt == "torch-export":
        program = torch.export.load(out / "model.pt2").module()
        return lambda inputs: program(**inputs)
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(out / "model.onnx"))
    return lambda inputs: torch.from_numpy(session.run(None, {k: v.numpy() for k, v in inputs.items()})[0])


def _case(pair):
    task_name, fmt = pair
    marks = [pytest.mark.slow] if fmt in ("torch-export", "onnx") and pair not in REFUSED else []
    return pytest.param(task_name, fmt, marks=marks, id=f"{task_name}-{fmt}")


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("task_name,fmt", [_case(p) for p in PAIRS])
def test_export_pair(runs, tmp_path, task_name, fmt, lora):
    run = runs(task_name, lora)
    out = tmp_path / "out"
    result = tk("export", run, "--format", fmt, "-o", out)
    if (task_name, fmt) in REFUSED:
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert REFUSED[task_name, fmt] in result.output and not out.exists()
        return
    assert result.exit_code == 0, result.output
    task, model = load_run(run, "best")
    inputs = _inputs(task_name, task, model)
    theirs = _load(task_name, fmt, out, run, lora, task)
    with torch.no_grad():
        expected, got = model(**inputs), theirs(inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))  # the same predictions
    for path in out.glob("*.safetensors"):  # a LoRA run's export holds merged weights only
        with safe_open(str(path), framework="pt") as f:
            assert not [k for k in f.keys() if "lora" in k]
    if lora:
        assert "adapters are merged into their base weights" in (out / "README.md").read_text()
    assert json.loads((out / ".tk-output").read_text())["tk_written_by"] == "tk export"
