"""Fine-tuning from timm weights (offline, model.pretrained_from): model.timm and arch: vit."""

import json

import pytest
import timm
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed, resample_patch_embed

from tk.core.cli import cli
from tk.core.config import ConfigError
from tk.core.engine.inference import evaluate_run, load_run
from tk.core.errors import TkError
from tk.core.nn.vit import load_timm_vit
from tk.core.recipe import load_config
from tk.plugins.image_classification.synthetic import SyntheticShapes

SMALL = ["data.num_train=32", "data.num_val=16", "train.batch_size=8", "train.eval_batch_size=16",
         "train.num_workers=0", "train.progress=false", "train.max_steps=2", "train.eval_every=2"]
VIT = {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}
TK_VIT = ["model.arch=vit", "model.patch_size=8", "model.dim=32", "model.depth=2", "model.num_heads=4",
          "model.mlp_ratio=2.0"]


def build_task(overrides):
    cfg, task_cls = load_config("quickstart", list(overrides))
    task = task_cls(cfg)
    task.setup()
    return task


def check_loaded(model, source, grid, heads=("head.",)):
    file_sd, own = source.state_dict(), model.state_dict()
    for key, value in file_sd.items():
        if key.startswith(heads):
            assert own[key].shape[0] == 10  # the task's classes, not the file's 3
        elif key == "pos_embed":
            torch.testing.assert_close(own[key], resample_abs_pos_embed(value, list(grid), num_prefix_tokens=1))
        else:
            torch.testing.assert_close(own[key], value, msg=key)


def run_and_reload(tmp_path, weights, overrides):
    run_dir = tmp_path / "run"
    args = ["run", "quickstart", f"output_dir={run_dir}", *SMALL, *overrides, f"model.pretrained_from={weights}"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert any("loss" in json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    weights.unlink()  # a finished run needs no pretrained file to evaluate or predict
    assert "val/top1" in evaluate_run(run_dir, "last")["metrics"]
    task, model = load_run(run_dir, "last")
    SyntheticShapes(1, split="test", seed=3)[0][0].save(tmp_path / "x.png")
    [pred] = task.predict(model, [str(tmp_path / "x.png")])
    assert len(pred["top_k"]) == 5


@pytest.mark.slow
def test_finetune_timm_from_file(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=3)  # grid 4x4
    weights = tmp_path / "w.safetensors"
    save_file(source.state_dict(), weights)
    overrides = ["model.timm=vit_tiny_patch16_224", "data.img_size=32", "model.freeze=all_but_last_2"]
    task = build_task([*overrides, f"model.pretrained_from={weights}"])
    model = task.build_model()
    task.init_pretrained(model)
    check_loaded(model, source, (2, 2))
    assert not model.patch_embed.proj.weight.requires_grad and model.blocks[-1].mlp.fc1.weight.requires_grad
    run_and_reload(tmp_path, weights, overrides)


def test_finetune_tk_vit_from_file(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", img_size=16, num_classes=3, **VIT)  # grid 2x2
    weights = tmp_path / "w.pth"
    torch.save(source.state_dict(), weights)
    task = build_task([*TK_VIT, f"model.pretrained_from={weights}"])
    model = task.build_model()
    task.init_pretrained(model)
    check_loaded(model, source, (4, 4))
    run_and_reload(tmp_path, weights, TK_VIT)


def test_tk_vit_from_another_patch_size():
    """Patch 8 weights into a patch-4 tk ViT: the kernel is resampled as timm does (FlexiViT),
    the position embeddings to the new 8x8 grid."""
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", img_size=16, num_classes=3, **VIT)  # patch 8, grid 2x2
    task = build_task([*TK_VIT, "model.patch_size=4"])
    model = task.build_model()
    load_timm_vit(model, source.state_dict() | {k: v for k, v in model.state_dict().items() if k.startswith("head.")})
    own = model.state_dict()
    kernel = source.state_dict()["patch_embed.proj.weight"]
    assert own["patch_embed.proj.weight"].shape[2:] == (4, 4)
    torch.testing.assert_close(own["patch_embed.proj.weight"], resample_patch_embed(kernel, [4, 4]))
    torch.testing.assert_close(own["pos_embed"], resample_abs_pos_embed(source.pos_embed, [8, 8], num_prefix_tokens=1))
    torch.testing.assert_close(own["blocks.1.attn.qkv.weight"], source.state_dict()["blocks.1.attn.qkv.weight"])


def test_tk_checkpoint_as_pretrained_from(tmp_path):
    """A tk ViT run's checkpoint is a valid model.pretrained_from (tk's ViT keeps timm's names):
    the backbone of the next run starts from it, its head is new."""
    first = tmp_path / "first"
    result = CliRunner().invoke(cli, ["run", "quickstart", f"output_dir={first}", *SMALL, *TK_VIT],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    ckpt = first / "checkpoints" / "last.pt"
    task = build_task([*TK_VIT, f"model.pretrained_from={ckpt}", "train.seed=5"])
    model = task.build_model()
    task.init_pretrained(model)
    _, trained = load_run(first, "last")
    for key, value in trained.state_dict().items():
        if key.startswith("head."):
            assert not torch.equal(model.state_dict()[key], value)
        else:
            torch.testing.assert_close(model.state_dict()[key], value, msg=key)


def test_missing_and_incompatible_pretrained_from(tmp_path):
    task = build_task([*TK_VIT, f"model.pretrained_from={tmp_path / 'none.pth'}"])
    with pytest.raises(TkError, match="none.pth does not exist"):
        task.init_pretrained(task.build_model())
    other = timm.create_model("vit_tiny_patch16_224", img_size=16, num_classes=3, **{**VIT, "embed_dim": 16})
    torch.save(other.state_dict(), tmp_path / "other.pth")
    task = build_task([*TK_VIT, f"model.pretrained_from={tmp_path / 'other.pth'}"])
    with pytest.raises(TkError, match=r"other.pth does not fit.*'(cls_token|patch_embed.proj.weight|pos_embed)'"):
        task.init_pretrained(task.build_model())


def test_conv_stem_with_timm_weights_is_one_line(tmp_path):
    weights = tmp_path / "vit.pth"
    torch.save({}, weights)
    with pytest.raises(ConfigError, match=r"model.stem \('conv'\): timm ViT weights .* have a patch stem"):
        build_task([*TK_VIT, "model.stem=conv", f"model.pretrained_from={weights}"])


def test_pretrained_without_network_suggests_pretrained_from(monkeypatch):
    """No hub (offline mode, as on a machine without network): one TkError that names the
    model and suggests model.pretrained_from."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, no retries
    task = build_task(["model.timm=vit_tiny_patch16_224", "model.pretrained=true", "data.img_size=32"])
    with pytest.raises(TkError, match=r"model.pretrained: cannot fetch .*'vit_tiny_patch16_224'.*model.pretrained_from"):
        task.init_pretrained(task.build_model())


def test_tk_vit_pretrained_from_a_timm_name(monkeypatch):
    """arch: vit + model.pretrained + model.pretrained_from: timm's published weights of that name
    (the hub download is replaced by a local model here); offline, the error suggests pretrained_from."""
    torch.manual_seed(0)
    published = timm.create_model("vit_tiny_patch16_224", img_size=16, num_classes=3, **VIT)
    real_create = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda name, pretrained=False, **kw: published
                        if pretrained else real_create(name, pretrained=pretrained, **kw))
    task = build_task([*TK_VIT, "model.pretrained=true", "model.pretrained_from=vit_tiny_patch16_224"])
    assert task.data_config["interpolation"] == "bicubic"  # vit_tiny_patch16_224's pretrained cfg
    model = task.build_model()
    task.init_pretrained(model)
    check_loaded(model, published, (4, 4))
    monkeypatch.setattr(timm, "create_model", real_create)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TkError, match=r"cannot fetch .*'vit_tiny_patch16_224'.*model.pretrained_from"):
        task.init_pretrained(task.build_model())


def test_layer_decay_on_a_timm_vit():
    task = build_task(["model.timm=vit_tiny_patch16_224", "data.img_size=32", "optim.layer_decay=0.5"])
    model = task.build_model()
    groups = task.param_groups(model, task.cfg.optim)
    scale = {n: g["lr_scale"] for g in groups for n in g["param_names"]}
    assert scale["head.weight"] == 1.0 and scale["blocks.11.norm1.weight"] == 0.5
    assert scale["patch_embed.proj.weight"] == pytest.approx(0.5 ** 13)


def test_pretrained_data_config_saved_with_the_run(tmp_path, monkeypatch):
    pad_cfg, task_cls = load_config("quickstart", ["model.timm=vit_tiny_patch16_224", "model.pretrained=true"])
    pad = task_cls(pad_cfg)
    assert pad.data_config["crop_pct"] == 1.0  # timm's crop_pct pairs with rrc training, not the pad crop
    cfg, task_cls = load_config("quickstart", ["model.timm=vit_tiny_patch16_224", "model.pretrained=true",
                                               "data.crop=rrc"])
    task = task_cls(cfg, tmp_path / "run")
    task.setup()
    # timm's augreg pretrained cfg (mean/std 0.5, bicubic, crop 0.9), not CIFAR's statistics
    expected = {"mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic", "crop_pct": 0.9}
    assert task.data_config == expected and task.normalization == ([0.5] * 3, [0.5] * 3)
    assert json.loads(task.files.read_text("normalize.json")) == expected
    resize = task._transform(training=False).transforms[0]
    assert resize.interpolation.value == "bicubic" and resize.size == round(32 / 0.9)
    # a finished run reads its saved config back, whatever the recipe now says
    again = task_cls(load_config("quickstart", ["data.crop_pct=1.0"])[0], tmp_path / "run")
    again.setup(resume=True)
    assert again.data_config == expected
    override = task_cls(load_config("quickstart", ["data.mean=[0.1,0.2,0.3]", "data.std=[1,1,1]",
                                                   "data.interpolation=bicubic"])[0])
    assert override.data_config == {"mean": [0.1, 0.2, 0.3], "std": [1.0, 1.0, 1.0], "interpolation": "bicubic",
                                     "crop_pct": 1.0}
