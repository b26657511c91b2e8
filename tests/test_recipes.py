"""Every built-in recipe parses, validates, and runs 2 steps on its offline data."""

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.recipe import builtin_recipes, load_config

RECIPES = sorted(builtin_recipes())

# Per task: overrides that swap downloads for generated data and shrink the run.
OFFLINE = {
    "image_classification": ["data.source=synthetic", "data.num_train=64", "data.num_val=32"],
    "text_classification": ["data.source=synthetic", "data.num_train=64", "data.num_val=32", "tokenizer.vocab_size=100",
                            "model.pretrained_from=null"],
    "translation": ["data.source=synthetic", "data.max_len=64", "data.max_tokens=512", "data.num_train=64",
                    "data.num_val=16", "tokenizer.vocab_size=300", "model.dim=32", "model.depth=1",
                    "model.hidden_dim=64", "decode.beam_size=1", "decode.max_len_b=4"],
    "language_model": ["data.source=synthetic", "data.num_sentences=500", "data.eval_blocks=4"],
    "mlm": ["data.source=synthetic", "data.num_sentences=300", "tokenizer.vocab_size=100"],
}
# Per recipe: overrides for what needs more than data offline (a teacher run, hub weights).
OFFLINE_RECIPE = {
    "deit_tiny_cifar": ["distill.teacher=resnet18"], "deit_tiny_cifar_cpu": ["distill.teacher=resnet18"],
    "sst2_distill": ["distill.type=none"],  # its teacher is the sst2_minilm run (needs SST-2 and MiniLM)
    "vit_finetune_cifar": ["model.pretrained=false", "data.img_size=64"],
    "vit_finetune_cifar_cpu": ["model.pretrained=false"],
    "vit_finetune_food101": ["model.pretrained=false", "data.img_size=64"],  # its local stand-in: test_image_sources
    "lm_smollm2_shakespeare": ["model.pretrained_from=null"],
    "translation_multi30k_marian": ["model.pretrained_from=null"],  # with a tiny stand-in: test_pretrained_translation  # with a tiny stand-in: test_pretrained_decoders
    "sft_smollm2_alpaca_lora": ["model.pretrained_from=null", "data.source=synthetic", "model.dim=32", "model.depth=1",
                                "model.num_heads=2", "model.lora.targets=[attention, mlp]", "model.dtype=float32",
                                "train.precision=fp32"],  # with a tiny stand-in: test_peft
    "gpt2_small_owt": ["tokenizer.path=null", "data.block_size=32", "data.val_fraction=0.1", "model.dim=32", "model.depth=1",
                       "model.num_heads=2", "train.grad_accum=1", "train.compile=false", "train.precision=fp32"],
}
SMALL = ["train.max_steps=2", "train.eval_every=2", "train.batch_size=8", "train.eval_batch_size=16",
         "train.num_workers=0", "train.progress=false"]


def test_recipes_exist():
    assert "quickstart" in RECIPES
    assert Path(builtin_recipes()["quickstart"]).parent.name == "recipes"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_opens_with_a_comment_and_validates(name):
    path = builtin_recipes()[name]
    text = path.read_text()
    assert text.startswith("#"), f"{path} must open with a comment: what it trains, its cost, the command"
    assert "tk run" in text.split("\n\n")[0], f"{path}: the header comment should give the exact command"
    cfg, _ = load_config(str(path))
    assert cfg.task == yaml.safe_load(text)["task"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_two_steps_offline(name, tmp_path):
    cfg, _ = load_config(name)
    args = ["run", name, f"output_dir={tmp_path / name}", *OFFLINE.get(cfg.task, []), *OFFLINE_RECIPE.get(name, []), *SMALL]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + result.stderr
    assert (tmp_path / name / "metrics.jsonl").is_file()
