"""``tk export``: each format loads in its own library and computes what the tk model does."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from tk.core.cli.main import cli
from tk.core.engine.inference import load_run
from tk.core.nn.generation.decoding import GenerationConfig
from tk.core.nn.generation import generate

FAST = ["train.progress=false", "train.num_workers=0", "train.max_steps=4", "train.eval_every=2"]
TEXTCLS = ["data.num_train=64", "data.num_val=16", "model.dim=32", "model.depth=2", "tokenizer.vocab_size=100",
           "model.norm_first=false"]  # BERT is post-norm
LM = ["data.num_sentences=300", "data.eval_blocks=2", "model.dim=32", "model.depth=2", "data.num_samples=0",
      "model.tie_embeddings=false"]
LLAMA = ["model.pos_encoding=rotary", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
         "model.num_kv_heads=2"]
VIT = ["data.num_train=64", "data.num_val=16", "model.dim=32", "model.depth=2", "train.batch_size=16",
       "train.eval_batch_size=16"]


def tk(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


tk_cli = tk  # where a test needs the name tk for the package


def make_run(path, recipe, *overrides):
    result = tk("run", recipe, f"output_dir={path}", *FAST, *overrides)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def textcls_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("export") / "tc", "textcls_synthetic", *TEXTCLS)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("export") / "vit", "quickstart", *VIT)


def export(run, fmt, *extra):
    result = tk("export", run, "--format", fmt, *extra)
    assert result.exit_code == 0, result.output
    return run / "export" / fmt


def test_textcls_to_bert_matches_tk_logits(textcls_run):
    transformers = pytest.importorskip("transformers")
    out = export(textcls_run, "hf")
    task, model = load_run(textcls_run, "best")
    sentences = ["good , not bad", "the film was bad , not good at all"]
    enc = task.encode(sentences, None)
    ids = task.collate([{"input_ids": i, "token_types": t} for i, t in zip(enc.ids, enc.type_ids)])["input_ids"]
    assert (ids == task.pad_id).any()  # a padded batch
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(sentences, padding=True, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        expected = model(ids)
        got = hf(input_ids=ids, attention_mask=(ids != task.pad_id).long()).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    card = (out / "README.md").read_text()
    assert "text_classification" in card and "val/top1" in card and "AutoModelForSequenceClassification" in card


@pytest.mark.parametrize("shape,hf_class", [([], "GPT2LMHeadModel"), (["model.norm_bias=false"], "GPT2LMHeadModel"),
                                            (LLAMA, "LlamaForCausalLM")])
def test_lm_to_transformers_greedy_tokens_match(tmp_path, shape, hf_class):
    transformers = pytest.importorskip("transformers")
    run = make_run(tmp_path / "lm", "lm_synthetic", *LM, *shape)
    out = export(run, "hf", "--checkpoint", "last")
    task, model = load_run(run, "last")
    prompt = torch.tensor([task.tokenizer.encode("the cat")])
    ours = generate(model, prompt, GenerationConfig(strategy="greedy", max_len=10)).tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == hf_class
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the export's ids: no pad/eos warning, no extra arguments
        theirs = hf.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert theirs[0, prompt.shape[1]:].tolist() == ours[0].tolist()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["the cat", "the cat sat on"], padding=True, return_tensors="pt")  # batched: a pad token
    assert tokenizer.pad_token_id == hf.generation_config.pad_token_id is not None
    assert batch["attention_mask"][0].tolist()[0] == 0  # left padding, as generation needs
    with torch.no_grad():  # and the logits themselves
        torch.testing.assert_close(hf(prompt).logits, model(prompt), atol=1e-5, rtol=1e-5)


def test_mlm_to_bert_for_masked_lm_matches_tk_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = make_run(tmp_path / "mlm", "mlm_synthetic", "data.num_sentences=300", "model.dim=32", "model.depth=2",
                   "model.norm_first=false", "tokenizer.vocab_size=100", "data.max_len=32")
    out = export(run, "hf")
    task, model = load_run(run, "best")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForMaskedLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["the cat [MASK] on the mat", "a dog"], padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    assert (ids == tokenizer.mask_token_id).any() and (ids == tokenizer.pad_token_id).any()
    with torch.no_grad():
        torch.testing.assert_close(hf(**batch).logits, model(ids), atol=1e-5, rtol=1e-5)
    assert "AutoModelForMaskedLM" in (out / "README.md").read_text()


@pytest.mark.parametrize("norm_bias", [True, False])
def test_vit_to_timm_matches_tk_logits(vit_run, tmp_path, norm_bias):
    timm = pytest.importorskip("timm")
    if not norm_bias:  # LayerNorms without bias: timm's always add one, so the export writes zeros
        vit_run = make_run(tmp_path / "vit", "quickstart", *VIT, "model.norm_bias=false")
        _, model = load_run(vit_run, "best")
        assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    out = export(vit_run, "timm")
    spec = json.loads((out / "timm_model.json").read_text())
    theirs = timm.create_model(spec["model_name"], pretrained=True, **spec["kwargs"], pretrained_cfg_overlay=dict(
        file=str(out / "model.safetensors"), num_classes=spec["kwargs"]["num_classes"])).eval()
    _, model = load_run(vit_run, "best")
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), model(x), atol=1e-5, rtol=1e-5)
    assert "timm.create_model(" in (out / "README.md").read_text()


def test_timm_export_loads_from_its_folder_with_the_runs_input_pipeline(vit_run, tmp_path):
    """``timm.create_model('local-dir:...')`` + timm's own data pipeline give ``tk predict``'s answers."""
    timm = pytest.importorskip("timm")
    from PIL import Image

    out = tmp_path / "timm"
    assert tk("export", vit_run, "--format", "timm", "-o", out).exit_code == 0
    net = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    task, model = load_run(vit_run, "best")
    data_config = timm.data.resolve_data_config({}, model=net)
    assert data_config["input_size"] == (3, 32, 32)
    assert list(data_config["mean"]) == pytest.approx(task.data_config["mean"])
    assert list(data_config["std"]) == pytest.approx(task.data_config["std"])
    assert net.pretrained_cfg["label_names"] == task.class_names
    transform = timm.data.create_transform(**data_config)
    paths = []
    for i, size in enumerate([(32, 32), (48, 40), (50, 64)]):  # other sizes: resized and cropped as tk does
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(i))
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(pixels.to(torch.uint8).numpy()).save(paths[-1])
    ours = task.predict(model, [str(p) for p in paths])
    with torch.no_grad():
        probs = net(torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])).softmax(-1)
    for record, row in zip(ours, probs):
        best = record["top_k"][0]
        assert task.class_names[int(row.argmax())] == best["label"]
        assert float(row.max()) == pytest.approx(best["prob"], abs=1e-5)


@pytest.mark.slow  # ~1 min: two traces per format
@pytest.mark.parametrize("fmt", ["torch-export", "onnx"])
def test_graph_exports_match_eager_at_two_batch_sizes(textcls_run, vit_run, fmt):
    if fmt == "onnx":
        ort = pytest.importorskip("onnxruntime")
    task, model = load_run(textcls_run, "best")
    enc = task.encode(["good", "bad , not good", "good , not bad at all"], None)
    ids = task.collate([{"input_ids": i, "token_types": t} for i, t in zip(enc.ids, enc.type_ids)])["input_ids"]
    _, vit = load_run(vit_run, "best")
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for run, net, name, batch in ((textcls_run, model, "input_ids", ids), (vit_run, vit, "x", images)):
        out = export(run, fmt)
        if fmt == "torch-export":
            program = torch.export.load(out / "model.pt2").module()
            run_graph = lambda t: program(**{name: t})  # noqa: E731
        else:
            session = ort.InferenceSession(str(out / "model.onnx"))
            run_graph = lambda t: torch.from_numpy(session.run(None, {name: t.numpy()})[0])  # noqa: E731
        for part in (batch[:1], batch):  # two batch sizes (and, for text, two lengths)
            with torch.no_grad():
                torch.testing.assert_close(run_graph(part), net(part), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_the_card_is_one_the_hub_reads_and_the_weights_say_where_they_come_from(textcls_run, tmp_path, fmt):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from safetensors import safe_open

    import tk

    out = tmp_path / fmt
    assert tk_cli("export", textcls_run, "--format", fmt, "-o", out).exit_code == 0
    card = huggingface_hub.ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data.get("library_name") == ("transformers" if fmt == "hf" else None)
    assert data["pipeline_tag"] == "text-classification" and set(data["tags"]) == {"tk", "text_classification", fmt}
    logged = [r for r in map(json.loads, (textcls_run / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "val"]
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    best = max(logged, key=lambda r: r["val/top1"]) if fmt else None
    assert results["val/top1"] == pytest.approx(best["val/top1"]) and "val/loss" in results
    assert "# text_classification: exported with tk" in card.text
    for path in (out / "model.safetensors", textcls_run / "model.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert meta["format"] == "pt" and meta["tk_version"] == tk.__version__
        assert meta["tk_task"] == "text_classification" and int(meta["tk_step"]) > 0


def test_an_hf_export_trains_on_in_transformers_as_in_tk(textcls_run):
    """10 AdamW steps at transformers' default lr on the same batches: the exported
    BertForSequenceClassification and tk's model give the same losses (no rescaled head)."""
    transformers = pytest.importorskip("transformers")
    out = export(textcls_run, "hf", "--overwrite")
    task, ours = load_run(textcls_run, "best", ["model.dropout=0.0", "model.head_dropout=0.0"])
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    rows = task.build_dataset("train")
    gen = torch.Generator().manual_seed(0)
    batches = [task.collate([rows[int(i)] for i in torch.randint(len(rows), (8,), generator=gen)]) for _ in range(10)]
    losses = {}
    for name, model in (("tk", ours), ("hf", theirs)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
        losses[name] = []
        for batch in batches:
            ids = batch["input_ids"]
            logits = model(ids) if name == "tk" else \
                model(input_ids=ids, attention_mask=(ids != task.pad_id).long()).logits
            loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["hf"] == pytest.approx(losses["tk"], abs=1e-4)
    assert losses["tk"][-1] < losses["tk"][0]  # it learns, and both models take the same path


def test_a_classifier_without_berts_pooler_is_refused_not_emulated(tmp_path):
    run = make_run(tmp_path / "run", "textcls_synthetic", *TEXTCLS, "model.pooler=false")
    _, model = load_run(run)
    assert model.pooler is None
    result = tk("export", run, "--format", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "BertForSequenceClassification cannot express 1 of this model's settings: model.pooler=False" in result.output
    assert "train with model.pooler=true" in result.output and not (tmp_path / "hf").exists()


def test_every_export_blocker_is_named_at_once(tmp_path):
    """A pre-norm classifier without the pooler: both blockers in one line, before anyone retrains (#51 item 14)."""
    run = make_run(tmp_path / "run", "textcls_synthetic", *TEXTCLS, "model.pooler=false", "model.norm_first=true")
    result = tk("export", run, "--format", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "cannot express 3 of this model's settings" in result.output  # the pooler, norm_first and final_norm
    assert "model.pooler=False" in result.output and "model.norm_first=True" in result.output


def test_bad_inputs_are_one_line_and_write_nothing(textcls_run, tmp_path):
    result = tk("export", textcls_run, "--format", "hff", "-o", tmp_path / "a")
    assert result.exit_code == 2 and "'hf'" in result.output and not (tmp_path / "a").exists()
    # a mean-pooled encoder: BertForSequenceClassification reads [CLS] only
    result = tk("export", textcls_run, "--format", "hf", "-o", tmp_path / "b", "model.pooling=mean",
                "model.pooler=false")  # the run's config.yaml records its pooler
    assert result.exit_code == 2 and "model.pooling='mean'" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):  # a user's folder: never replaced, and --overwrite is not suggested
        result = tk("export", textcls_run, "--format", "safetensors", "-o", tmp_path / "c", *extra)
        assert result.exit_code == 2 and "a folder tk did not write" in result.output
        assert "pass --overwrite" not in result.output and len(result.output.strip().splitlines()) == 1
        assert [p.name for p in (tmp_path / "c").iterdir()] == ["keep.txt"]
    result = tk("export", textcls_run, "--format", "safetensors", "-o", tmp_path / "d")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [".tk-output", "README.md", "artifacts",
                                                                  "model.safetensors"]
    result = tk("export", textcls_run, "--format", "safetensors", "-o", tmp_path / "d")  # tk's own output
    assert result.exit_code == 2 and "pass --overwrite to replace it" in result.output
    result = tk("export", textcls_run, "--format", "safetensors", "-o", tmp_path / "d", "--overwrite")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]  # no temporary folder left beside it


# -- LoRA runs: every format holds the merged model (issue #34 item 2) --------------------
LORA = ["model.lora.rank=4", "optim.lr=0.01", "train.max_steps=6"]  # adapters far from their zero start


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"textcls": make_run(root / "tc", "textcls_synthetic", *TEXTCLS, *LORA),
            "lm": make_run(root / "lm", "lm_synthetic", *LM, *LORA),
            "vit": make_run(root / "vit", "quickstart", *VIT, *LORA)}


def _inputs(kind, task):
    if kind == "textcls":
        enc = task.encode(["good , not bad", "the film was bad , not good at all"], None)
        return task.collate([{"input_ids": i, "token_types": t} for i, t in zip(enc.ids, enc.type_ids)])["input_ids"]
    if kind == "lm":
        return torch.tensor([task.tokenizer.encode("the cat sat on the mat")])
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _load_export(kind, fmt, out, run, task):
    """A callable ids/images -> logits, from the exported files through their own library."""
    if fmt == "hf":
        transformers = pytest.importorskip("transformers")
        auto = transformers.AutoModelForSequenceClassification if kind == "textcls" else \
            transformers.AutoModelForCausalLM
        hf = auto.from_pretrained(out).eval()
        pad = getattr(task, "pad_id", None)
        return lambda x: hf(input_ids=x, **({"attention_mask": (x != pad).long()} if kind == "textcls" else {})).logits
    if fmt == "timm":
        timm = pytest.importorskip("timm")
        spec = json.loads((out / "timm_model.json").read_text())
        net = timm.create_model(spec["model_name"], pretrained=True, **spec["kwargs"], pretrained_cfg_overlay=dict(
            file=str(out / "model.safetensors"), num_classes=spec["kwargs"]["num_classes"])).eval()
        return net
    if fmt == "safetensors":  # the same model built without model.lora loads the file strictly
        _, plain = load_run(run, overrides=["model.lora=null"], weights=str(out / "model.safetensors"))
        return plain
    name = "input_ids" if kind == "textcls" else "x"
    if fmt == "torch-export":
        program = torch.export.load(out / "model.pt2").module()
        return lambda x: program(**{name: x})
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(out / "model.onnx"))
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


@pytest.mark.parametrize("kind,fmt", [
    ("textcls", "hf"), ("textcls", "safetensors"), ("lm", "hf"), ("vit", "timm"), ("vit", "safetensors"),
    pytest.param("textcls", "torch-export", marks=pytest.mark.slow),
    pytest.param("textcls", "onnx", marks=pytest.mark.slow),
    pytest.param("vit", "onnx", marks=pytest.mark.slow)])
def test_a_lora_run_exports_merged_weights_in_every_format(lora_runs, kind, fmt, tmp_path):
    run = lora_runs[kind]
    out = tmp_path / fmt
    result = tk("export", run, "--format", fmt, "-o", out)
    assert result.exit_code == 0, result.output
    task, model = load_run(run, "best")
    x = _inputs(kind, task)
    base = copy.deepcopy(model)
    for name, p in base.named_parameters():
        if name.endswith("lora_B"):
            p.data.zero_()  # the base model alone, what an export that drops the adapters computes
    theirs = _load_export(kind, fmt, out, run, task)
    with torch.no_grad():
        expected, without = model(x), base(x)
        assert (expected - without).abs().max() > 1e-4  # the adapters matter here (10x the tolerance)
        torch.testing.assert_close(theirs(x), expected, atol=1e-5, rtol=1e-5)
    assert "adapters are merged into their base weights" in (out / "README.md").read_text()
    if fmt in ("hf", "timm", "safetensors"):
        from safetensors import safe_open

        files = list(out.glob("*.safetensors"))
        with safe_open(str(files[0]), framework="pt") as f:
            assert files and not [k for k in f.keys() if "lora" in k]  # no adapter tensors


@pytest.mark.parametrize("img_size,crop_pct", [(32, 1.0), (32, 0.875), (224, 0.9), (224, 0.95), (384, 1.0)])
def test_timm_pretrained_cfg_makes_timms_eval_transform_tks(img_size, crop_pct):
    timm = pytest.importorskip("timm")
    from PIL import Image

    from tk.core.exchange.export_timm import timm_hub_config
    from tk.plugins.image_classification.transforms import build_eval_transform

    data = {"mean": [0.4, 0.5, 0.6], "std": [0.2, 0.25, 0.3], "interpolation": "bicubic", "crop_pct": crop_pct}
    cfg = timm_hub_config("vit_base_patch16_224", {"num_classes": 3}, img_size, data, None)["pretrained_cfg"]
    theirs = timm.data.create_transform(input_size=tuple(cfg["input_size"]), interpolation=cfg["interpolation"],
                                        mean=cfg["mean"], std=cfg["std"], crop_pct=cfg["crop_pct"],
                                        crop_mode=cfg["crop_mode"])
    ours = build_eval_transform(img_size, data["mean"], data["std"], crop_pct, "bicubic")
    pixels = torch.randint(0, 256, (300, 400, 3), generator=torch.Generator().manual_seed(img_size)).to(torch.uint8)
    image = Image.fromarray(pixels.numpy())
    torch.testing.assert_close(theirs(image), ours(image), atol=0, rtol=0)


def test_hf_export_refuses_a_plugin_text_encoder_model_and_takes_its_hook():
    """A tagger (core TextEncoder + a linear head, no classifier pooling) is refused in one line,
    not an AttributeError; a task's export_hf hook is used as it is."""
    import pytest
    from torch import nn

    from tk.core.errors import TkError
    from tk.core.exchange.export_hf import hf_export
    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.text_encoder import TextEncoder

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = TextEncoder(TransformerConfig(dim=16, depth=1, num_heads=2, pos_encoding="learned",
                                                         max_len=8), 50)
            self.head = nn.Linear(16, 3)

    class Task:
        name = "tagging"

    with pytest.raises(TkError, match="task 'tagging' has a Tagger.*Task.export_hf"):
        hf_export(Task(), Tagger())
    Task.export_hf = lambda self, model: ({"model_type": "bert"}, {"w": model.head.weight})
    config, state = hf_export(Task(), Tagger())
    assert config == {"model_type": "bert"} and set(state) == {"w"}


def test_an_unfinished_run_and_a_missing_best_are_said_not_substituted_silently(textcls_run, tmp_path):
    """#51 item 11: tk export of a run that did not finish, whose best.pt is missing, says both in its
    line and in the card."""
    import json
    import shutil

    run = tmp_path / "unfinished"
    shutil.copytree(textcls_run, run)
    (run / "checkpoints" / "best.pt").unlink()
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "status": "interrupted"}))
    result = tk("export", run, "--format", "safetensors", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "note: the run is unfinished: interrupted at step" in result.output
    assert "no best.pt" in result.output and "its last checkpoint instead" in result.output
    assert "(the run is unfinished: interrupted" in (tmp_path / "out" / "README.md").read_text()


def test_the_card_states_a_license_names_its_entry_after_the_run_and_lists_only_hub_datasets(textcls_run, tmp_path):
    """#51 item 16: --license is the card's license; the model-index entry is the run's name (not "config");
    a local or packaged-builder data.hf_name is no hub dataset id."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from tk.core.exchange.card import _hub_dataset

    out = tmp_path / "card"
    assert tk_cli("export", textcls_run, "--format", "safetensors", "-o", out, "--license", "apache-2.0").exit_code == 0
    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0" and card.data.model_name == textcls_run.name
    assert [_hub_dataset(n) for n in ("parquet", str(tmp_path), "stanfordnlp/sst2", "glue")] == \
        [None, None, "stanfordnlp/sst2", "glue"]
