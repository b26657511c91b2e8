"""``model.pretrained_from: RUN_DIR``: a finished tk run as the pretrained source of a new run
(text_classification <- text_classification, language_model <- language_model,
image_classification <- a ViT run), and the one-line errors of bad sources."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.recipe import load_config
from tk.core.training.assemble import assemble

TEXTCLS = ["data.num_train=64", "data.num_val=16", "train.batch_size=16", "train.eval_batch_size=16",
           "train.max_steps=2", "train.eval_every=2", "train.progress=false", "train.num_workers=0",
           "model.dim=32", "model.depth=1", "model.num_heads=4", "tokenizer.vocab_size=100"]
LM = ["data.num_sentences=300", "train.max_steps=2", "train.eval_every=2", "train.progress=false",
      "train.num_workers=0", "train.batch_size=4", "data.eval_blocks=4", "data.num_samples=0", "model.dim=32",
      "model.depth=1", "data.block_size=32", "model.max_len=64"]


def tk(args):
    return CliRunner().invoke(cli, args)


def train(recipe, run_dir, overrides):
    result = tk(["run", recipe, f"output_dir={run_dir}", *overrides])
    assert result.exit_code == 0, result.output
    return run_dir


def fresh(recipe, run_dir, overrides):
    """The new run's task and model at step 0, built as `tk run` builds them (mode "train")."""
    cfg, task_cls = load_config(recipe, list(overrides))
    run_dir.mkdir()
    built = assemble(cfg, task_cls, run_dir, "train")
    return built.task, built.model


@pytest.fixture(scope="module")
def textcls_run(tmp_path_factory):
    return train("textcls_synthetic", tmp_path_factory.mktemp("src") / "run", [*TEXTCLS, "model.hidden_dim=48"])


def test_text_classification_from_a_run(textcls_run, tmp_path):
    """Every encoder tensor equals the source's at step 0, the head is fresh, the tokenizer file
    is the source's (byte for byte); a shape key the recipe leaves at its default takes the source's value."""
    _, source = load_run(textcls_run, "best")
    task, model = fresh("textcls_synthetic", tmp_path / "new",  # no model.hidden_dim: the source's 48
                        [*TEXTCLS, "data.seed=1", "train.seed=7", f"model.pretrained_from={textcls_run}"])
    mine, theirs = model.state_dict(), source.state_dict()
    encoder = [k for k in theirs if k.startswith("encoder.")]
    assert len(encoder) > 10 and model.encoder.cfg.dim == 32 and model.encoder.cfg.hidden_dim == 48
    for key in encoder:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    assert not torch.equal(mine["head.weight"], theirs["head.weight"])  # a new head
    tokenizer = "artifacts/tokenizer.json"
    assert (tmp_path / "new" / tokenizer).read_bytes() == (textcls_run / tokenizer).read_bytes()
    record = json.loads((tmp_path / "new" / "artifacts" / "pretrained.json").read_text())
    assert record["task"] == "text_classification" and record["model"]["hidden_dim"] == 48


def test_text_classification_with_lora_from_a_tk_run_trains_evaluates_and_exports(textcls_run, tmp_path):
    """model.lora with a tk run as the source (the adapters' config survives the encoder spec's
    JSON round trip): the encoder starts as the source's, only adapters and head train, eval works."""
    run = train("textcls_synthetic", tmp_path / "new", [*TEXTCLS, f"model.pretrained_from={textcls_run}",
                                                        "model.lora.rank=4"])
    _, source = load_run(textcls_run, "best")
    _, model = load_run(run, "best")
    assert any(k.endswith("lora_A") for k in model.state_dict())
    frozen = {k: v for k, v in source.state_dict().items() if k.startswith("encoder.") and "embed" in k}
    for key, value in frozen.items():  # not an adapter target: frozen, still the source's
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert tk(["eval", str(run), "--json"]).exit_code == 0


def test_the_run_records_the_shape_it_built_and_says_what_the_source_gave(tmp_path):
    """An mlm source with norm_first=false: config.yaml and the export's card record the built
    shape (post-norm, BERT's pooler on), train.log says what was loaded, what is new, what LoRA froze."""
    mlm = train("mlm_synthetic", tmp_path / "mlm", [*MLM[:1], "train.max_steps=2", "train.eval_every=2",
                                                    "train.progress=false", "model.dim=32", "model.depth=1",
                                                    "model.num_heads=4", "model.norm_first=false",
                                                    "tokenizer.vocab_size=200"])
    run = train("textcls_synthetic", tmp_path / "tc", [*TEXTCLS, f"model.pretrained_from={mlm}",
                                                      "model.lora.rank=4"])
    built = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert built["norm_first"] is False and built["pooler"] is True and built["dim"] == 32
    log = (run / "train.log").read_text()
    assert f"model.pretrained_from: 17 encoder tensors from {mlm} (mlm run, best.pt); new: pooler, head (2 classes); " \
           "shape: dim=32, depth=1, num_heads=4, hidden_dim=64, activation=gelu, norm=layernorm, norm_first=False" in log
    assert "model.lora: rank-4 adapters on 2 Linear layers" in log and "(the adapters and head.bias, head.weight, " \
           "pooler.bias, pooler.weight), 17 tensors" in log
    assert tk(["export", str(run), "--format", "hf", "-o", str(tmp_path / "hf")]).exit_code == 0
    assert "norm_first: false" in (tmp_path / "hf" / "README.md").read_text()


def test_max_steps_0_evaluates_and_saves_the_starting_model_and_resumes_exactly(textcls_run, tmp_path):
    """train.max_steps=0: no update; the loaded encoder is evaluated (step 0) and saved, so it can
    be checked before fine-tuning; continuing to 2 steps equals a straight 2-step run."""
    from safetensors.torch import load_file

    source_args = [*TEXTCLS, f"model.pretrained_from={textcls_run}"]
    zero = train("textcls_synthetic", tmp_path / "zero", [*source_args, "train.max_steps=0"])
    records = [json.loads(line) for line in (zero / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records] == [(0, "val")]
    _, source = load_run(textcls_run, "best")
    saved = load_file(zero / "model.safetensors")
    for key, value in source.state_dict().items():
        if key.startswith("encoder."):
            torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)
    assert (zero / "checkpoints" / "last.pt").is_file() and (zero / "checkpoints" / "best.pt").is_file()
    train("textcls_synthetic", zero, [*source_args, "train.max_steps=2", "--resume"])
    straight = train("textcls_synthetic", tmp_path / "straight", [*source_args, "train.max_steps=2"])
    last = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (zero / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("val/loss") for r in resumed if r["step"] == 2] == [r.get("val/loss") for r in last if r["step"] == 2]
    bad = tk(["run", "textcls_synthetic", f"output_dir={tmp_path / 'neg'}", "train.max_steps=-1"])
    assert bad.exit_code == 2 and "train.max_steps=-1': must be >= 0" in bad.output


def test_text_classification_run_then_eval_without_the_source(textcls_run, tmp_path):
    """The CLI end to end: the new run trains, and evaluates after the source is gone (it is
    self-contained); a checkpoint file is a source too."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(textcls_run, copy)
    new = train("textcls_synthetic", tmp_path / "new",
                [*TEXTCLS, "data.seed=1", f"model.pretrained_from={copy / 'checkpoints' / 'last.pt'}"])
    shutil.rmtree(copy)
    result = tk(["eval", str(new), "--checkpoint", "last"])
    assert result.exit_code == 0, result.output
    resumed = tk(["run", "textcls_synthetic", f"output_dir={new}", *TEXTCLS, "data.seed=1", "train.max_steps=3",
                  f"model.pretrained_from={copy}", "--resume"])  # resume never reads the (gone) source
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.parametrize("override, message", [
    ("model.dim=48", r"model.dim: the recipe sets 48 but the model.pretrained_from run was trained with 32"),
    # typed beside the source: an error even at its default (2), not silently replaced by the source's 1
    ("model.depth=2", r"model.depth=2 \(the source: 1\)"),
    ("model.pretrained_from={missing}", r"model.pretrained_from: .*missing.* does not exist"),
])
def test_text_classification_bad_sources(textcls_run, tmp_path, override, message):
    import re

    base = [k for k in TEXTCLS if not k.startswith("model.")]
    out = tmp_path / "new"
    result = tk(["run", "textcls_synthetic", f"output_dir={out}", *base, f"model.pretrained_from={textcls_run}",
                 override.format(missing=tmp_path / "missing")])
    assert result.exit_code == 2, result.output
    assert re.search(message, result.output) and len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()  # nothing written


def test_errors_name_the_problem(textcls_run, tmp_path):
    lm_run = train("lm_synthetic", tmp_path / "lm", LM)
    cases = {  # override -> what the one line says
        f"model.pretrained_from={lm_run}": "is a language_model run; a text_classification run can start from "
                                           "a text_classification or mlm run",
        f"model.pretrained_from={tmp_path / 'empty'}": "has no checkpoint",
        f"model.pretrained_from={tmp_path / 'bad.pt'}": "cannot read checkpoint",
        "model.pretrained_dir=x": "model.pretrained_dir was renamed to model.pretrained_from",
    }
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("task: text_classification\n")
    (tmp_path / "bad.pt").write_bytes(b"PK not really")
    base = [k for k in TEXTCLS if not k.startswith("model.")]
    for override, expected in cases.items():
        out = tmp_path / "out"
        result = tk(["run", "textcls_synthetic", f"output_dir={out}", *base, override])
        assert result.exit_code == 2 and expected in result.output, (override, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert not out.exists(), override
    result = tk(["validate", "textcls_synthetic", f"model.pretrained_from={lm_run}"])  # validate checks it too
    assert result.exit_code == 2 and "is a language_model run" in result.output, result.output


def test_language_model_continued_on_other_data(tmp_path):
    """An LM run continues on other generated text: same tokenizer file, every weight at step 0
    the source's; a recipe asking for another tokenizer is refused."""
    src = train("lm_synthetic", tmp_path / "src", [*LM, "model.num_kv_heads=2"])
    _, source = load_run(src, "last")
    new = LM  # no model.num_kv_heads: the source's 2
    task, model = fresh("lm_synthetic", tmp_path / "new", [*new, "data.seed=3", f"model.pretrained_from={src}"])
    for key, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    tokenizer = "artifacts/tokenizer.json"
    assert (tmp_path / "new" / tokenizer).read_bytes() == (src / tokenizer).read_bytes()
    assert task.model_cfg.num_kv_heads == 2 and task.model_cfg.dim == 32
    for bad, expected in (("tokenizer.kind=bpe", "tokenizer.kind: the recipe asks for 'bpe' but"),
                          (f"tokenizer.path={src / tokenizer}", "tokenizer.path: model.pretrained_from brings")):
        out = tmp_path / "bad"
        result = tk(["run", "lm_synthetic", f"output_dir={out}", *new, f"model.pretrained_from={src}", bad])
        assert result.exit_code == 2 and expected in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    # end to end, then the continued run reloads with the adopted shape (its config.yaml has no num_kv_heads)
    cont = train("lm_synthetic", tmp_path / "cont", [*new, "data.seed=3", f"model.pretrained_from={src}"])
    task, model = load_run(cont, "last")
    assert task.model_cfg.num_kv_heads == 2


VIT = ["data.num_train=32", "data.num_val=16", "train.batch_size=8", "train.eval_batch_size=16", "train.max_steps=2",
       "train.eval_every=2", "train.num_workers=0", "train.progress=false", "model.patch_size=8", "model.dim=32",
       "model.depth=2", "model.num_heads=4"]


def image_folder(root):
    """3 classes of 32x32 images in root/train and root/val (another class count than the source's 10)."""
    from PIL import Image

    for split in ("train", "val"):
        for c, colour in enumerate(("red", "green", "blue")):
            (root / split / colour).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (32, 32), colour).save(root / split / colour / f"{i}.png")
    return root


def test_image_classification_from_a_vit_run(tmp_path):
    """A quickstart ViT run -> a 3-class image-folder run: the backbone is the source's at step 0,
    the head new (3 classes), the normalisation the source's; the old key names the new one."""
    src = train("quickstart", tmp_path / "src", [*VIT, "model.mlp_ratio=3.0"])
    _, source = load_run(src, "last")
    root = image_folder(tmp_path / "images")
    task, model = fresh("quickstart", tmp_path / "new", [*VIT, "data.source=imagefolder", f"data.root={root}",
                                                        f"model.pretrained_from={src}"])
    theirs, mine = source.state_dict(), model.state_dict()
    assert task.model_cfg.mlp_ratio == 3.0 and mine["head.weight"].shape[0] == 3
    for key, value in theirs.items():
        if not key.startswith("head."):
            torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    norm = "artifacts/normalize.json"
    assert json.loads((tmp_path / "new" / norm).read_text()) == json.loads((src / norm).read_text())
    result = tk(["run", "quickstart", f"output_dir={tmp_path / 'old'}", *VIT, f"model.pretrained_file={src}"])
    assert result.exit_code == 2 and "model.pretrained_file was renamed to model.pretrained_from" in result.output
    result = tk(["run", "quickstart", f"output_dir={tmp_path / 'bad'}", *VIT, "model.dim=48",
                 f"model.pretrained_from={src}"])
    assert result.exit_code == 2 and "model.dim: the recipe sets 48 but" in result.output, result.output
    assert not (tmp_path / "bad").exists()


def test_translation_takes_hf_translators_not_tk_runs(tmp_path):
    """translation starts from Marian/NLLB folders (tests/plugins/test_pretrained_translation.py); a
    folder without config.json and a tk run dir are one line each."""
    result = tk(["run", "translation_multi30k_marian", "data.source=synthetic", f"output_dir={tmp_path / 'tr'}",
                 f"model.pretrained_from={tmp_path}"])
    assert result.exit_code == 2 and "has no config.json" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "tr").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("task: translation\n")
    result = tk(["run", "translation_multi30k_marian", "data.source=synthetic", f"output_dir={tmp_path / 'tr'}",
                 f"model.pretrained_from={tmp_path / 'run'}"])
    assert result.exit_code == 2 and "is a tk run; translation starts from a Hugging Face translator" in result.output


def test_an_mlm_run_is_a_source(textcls_run, tmp_path):
    """Any run whose model keeps a TextEncoder under encoder.* (an mlm run: task mlm, its own head)."""
    import shutil

    import yaml

    mlm = tmp_path / "mlm"
    shutil.copytree(textcls_run, mlm)
    config = yaml.safe_load((mlm / "config.yaml").read_text())
    (mlm / "config.yaml").write_text(yaml.safe_dump({**config, "task": "mlm"}))
    _, model = fresh("textcls_synthetic", tmp_path / "new", [*TEXTCLS, f"model.pretrained_from={mlm}"])
    _, source = load_run(textcls_run, "best")
    torch.testing.assert_close(model.encoder.tok_embed.weight, source.encoder.tok_embed.weight, rtol=0, atol=0)


def test_load_backbone_names_the_first_misfit():
    from tk.core.engine.inference import load_backbone
    from tk.core.errors import TkError

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    weights = {"0.weight": torch.ones(3, 4), "0.bias": torch.ones(3), "1.weight": torch.ones(2, 3)}
    assert load_backbone(model, weights, exclude=("1.",)) == ["0.weight", "0.bias"]
    assert torch.equal(model[0].weight, torch.ones(3, 4)) and not torch.equal(model[1].weight, torch.ones(2, 3))
    with pytest.raises(TkError, match=r"tensor '0.weight' is \(5, 4\) in the source but \(3, 4\) in this model"):
        load_backbone(model, {**weights, "0.weight": torch.ones(5, 4)})
    with pytest.raises(TkError, match=r"the source model has no tensor '1.bias'"):
        load_backbone(model, weights)


MLM = ["data.num_sentences=3000", "train.batch_size=32", "train.eval_batch_size=64", "train.max_steps=40",
       "train.eval_every=40", "train.progress=false", "train.num_workers=0", "model.dim=32", "model.depth=1",
       "model.num_heads=4", "data.max_len=32", "tokenizer.vocab_size=200"]
FINETUNE = ["data.num_train=64", "data.num_val=16", "train.max_steps=2", "train.progress=false", "model.dim=32",
            "model.depth=1", "model.num_heads=4", "data.max_len=32"]


def test_mlm_run_is_the_pretrained_source_of_text_classification(tmp_path):
    """Pretrain -> fine-tune: `tk run mlm_synthetic`, then `tk run textcls_synthetic
    model.pretrained_from=<mlm run>`: every encoder tensor equals the MLM run's at step 0."""
    source = train("mlm_synthetic", tmp_path / "mlm", MLM)
    _, mlm_model = load_run(source, "best")
    _, model = fresh("textcls_synthetic", tmp_path / "step0", [*FINETUNE, f"model.pretrained_from={source}"])
    theirs, mine = mlm_model.state_dict(), model.state_dict()
    encoder = [k for k in theirs if k.startswith("encoder.")]
    assert len(encoder) > 10
    for key in encoder:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_fine_tuning_from_an_mlm_run_beats_its_from_scratch_twin(tmp_path):
    """The recipes' own shapes (rotary positions in both): 600 MLM updates on the generated
    sentences, then 200 fine-tuning updates (seed 0 both). From scratch the classifier is still
    near chance (measured 0.61; with a 400-update schedule it learns "not ADJ" only after update
    150); the pretrained encoder already knows that the adjectives of a sentence agree unless a
    "not" flips one (measured 1.00, 0.72 at update 100)."""
    source = train("mlm_synthetic", tmp_path / "mlm", ["model.pos_encoding=rotary", "train.max_steps=600",
                                                      "train.eval_every=600", "train.progress=false"])
    common = ["train.max_steps=200", "train.eval_every=200", "schedule.warmup_steps=20", "train.progress=false",
              "train.seed=0"]
    scratch = train("textcls_synthetic", tmp_path / "scratch", [*common, "model.pos_encoding=rotary"])
    tuned = train("textcls_synthetic", tmp_path / "tuned", [*common, f"model.pretrained_from={source}"])

    def top1(run_dir: Path) -> float:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["val/top1"] for r in records if "val/top1" in r][-1]

    assert top1(scratch) < 0.75 and top1(tuned) > top1(scratch) + 0.2, (top1(scratch), top1(tuned))


# -- a plugin's one-line opt-in: Task.pretrained_backbone -------------------------------------
def _toy(tmp_path, name, *overrides):
    recipe = tmp_path / "toy_backbone.yaml"
    recipe.write_text("task: tests.core.backbone_task:BackboneTask\ndata: {num_train: 32, num_val: 8}\n"
                      "train: {max_steps: 3, batch_size: 8, eval_every: 3, progress: false}\n")
    return tk(["run", str(recipe), f"output_dir={tmp_path / name}", *overrides])


def test_a_declared_backbone_is_seeded_by_the_engine(tmp_path):
    """The source's shape, files and backbone tensors come over; the head stays fresh; the new run
    reloads with the recorded shape; a disagreeing shape key or another task is one line."""
    from tk.core.engine.inference import load_run

    assert _toy(tmp_path, "a", "model.hidden=48").exit_code == 0
    result = _toy(tmp_path, "b", f"model.pretrained_from={tmp_path / 'a'}", "train.max_steps=0")
    assert result.exit_code == 0, result.output
    assert "3 tensors under 'encoder.' from the tests.core.backbone_task:BackboneTask run" in (tmp_path / "b" / "train.log").read_text()
    assert (tmp_path / "b" / "artifacts" / "vocab.txt").read_text() == "48 ids of a run\n"
    _, a = load_run(tmp_path / "a", "last", [])
    _, b = load_run(tmp_path / "b", "last", [])  # restored with the recorded hidden=48, not the default 32
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb) == name.startswith("encoder."), name
    result = _toy(tmp_path, "c", f"model.pretrained_from={tmp_path / 'a'}", "model.hidden=16")
    assert result.exit_code == 2 and "model.hidden: the recipe sets 16 but the model.pretrained_from run was trained " \
        "with 48" in result.output and not (tmp_path / "c").exists()
    result = _toy(tmp_path, "d", f"model.pretrained_from={textcls_dir(tmp_path)}")
    assert result.exit_code == 2 and "is a text_classification run; a toy_backbone run can start from a toy_backbone" \
        in result.output
    result = _toy(tmp_path, "e", f"model.pretrained_from={tmp_path / 'nothing'}")
    assert result.exit_code == 2 and "neither a tk run dir" in result.output and not (tmp_path / "e").exists()


def textcls_dir(tmp_path):
    """A folder that looks like a run of another task."""
    (tmp_path / "other" / "checkpoints").mkdir(parents=True, exist_ok=True)
    (tmp_path / "other" / "config.yaml").write_text("task: text_classification\n")
    torch.save({"model": {}}, tmp_path / "other" / "checkpoints" / "last.pt")
    return tmp_path / "other"
