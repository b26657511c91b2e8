"""Tests for the image_classification plugin: data sources, Mixup, loss, models, metrics, predict."""

import json
import logging
import os
import pickle
import urllib.error

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from timm.loss import SoftTargetCrossEntropy

from tk.core.config import ConfigError
from tk.core.errors import TkError
from tk.core.recipe import load_config
from tk.plugins.image_classification import ImageClassificationTask
from tk.plugins.image_classification.data import MEAN_STD
from tk.plugins.image_classification.metrics import ConfusionMatrix
from tk.plugins.image_classification.synthetic import SyntheticShapes
from tk.plugins.image_classification.transforms import build_train_transform, check_auto_augment

TOY_MODEL = {"patch_size": 8, "dim": 32, "depth": 2, "num_heads": 4}


def make_task(tmp_path, overrides=(), **sections) -> ImageClassificationTask:
    """A task from a recipe written to tmp_path (goes through the real config loader)."""
    recipe = {"task": "image_classification", "model": TOY_MODEL, "train": {"batch_size": 8},
              "output_dir": str(tmp_path / "run")}
    recipe.update(sections)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cfg, task_cls = load_config(str(path), list(overrides))
    return task_cls(cfg)


def write_pngs(folder, count, seed, size=12):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i}.png"))


# -- synthetic data ------------------------------------------------------------------
def test_synthetic_set_is_deterministic_per_seed():
    a, b, c = SyntheticShapes(20, seed=1), SyntheticShapes(20, seed=1), SyntheticShapes(20, seed=2)
    for i in (0, 7, 19):
        assert np.array_equal(np.asarray(a[i][0]), np.asarray(b[i][0]))
        assert not np.array_equal(np.asarray(a[i][0]), np.asarray(c[i][0]))
    val = SyntheticShapes(20, split="val", seed=1)
    assert not np.array_equal(np.asarray(a[3][0]), np.asarray(val[3][0]))
    assert [a[i][1] for i in range(20)] == [i % 10 for i in range(20)]
    assert np.asarray(a[0][0]).shape == (32, 32, 3)


def test_task_batch_forward_backward(tmp_path):
    torch.manual_seed(0)
    task = make_task(tmp_path, data={"num_train": 16, "num_val": 8})
    ds = task.build_dataset("train")
    batch = task.collate([ds[i] for i in range(8)])
    assert batch["image"].shape == (8, 3, 32, 32) and batch["labels"].dtype == torch.long
    model = task.build_model()
    out = task.loss(model, task.transform_batch(batch, training=True))
    assert out.num_items == 8 and out.outputs.shape == (8, 10)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.outputs, batch["labels"], reduction="sum"))
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# -- Mixup / CutMix and the loss ------------------------------------------------------
def test_mixup_soft_targets_and_soft_target_loss(tmp_path):
    torch.manual_seed(0)
    np.random.seed(0)  # timm's Mixup draws lambda from numpy
    task = make_task(tmp_path, data={"num_train": 16},
                     mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mode": "elem"}, loss={"label_smoothing": 0.1})
    batch = task.collate([task.build_dataset("train")[i] for i in range(8)])
    mixed = task.transform_batch(batch, training=True)
    targets = mixed["labels"]
    assert targets.shape == (8, 10)
    torch.testing.assert_close(targets.sum(-1), torch.ones(8))
    assert targets.min() >= 0.1 / 10 - 1e-6  # loss.label_smoothing reaches Mixup's targets
    assert not torch.equal(mixed["image"], batch["image"])
    assert torch.equal(task.transform_batch(batch, training=False)["labels"], batch["labels"])  # eval: untouched
    model = task.build_model()
    out = task.loss(model, mixed)
    by_hand = -(targets * out.outputs.log_softmax(-1)).sum()
    torch.testing.assert_close(out.loss, by_hand)
    torch.testing.assert_close(out.loss, SoftTargetCrossEntropy()(out.outputs, targets) * 8)


def test_label_smoothing_without_mixing(tmp_path):
    torch.manual_seed(0)
    task = make_task(tmp_path, data={"num_train": 16}, loss={"label_smoothing": 0.2})
    batch = task.collate([task.build_dataset("train")[i] for i in range(8)])
    model = task.build_model()
    out = task.loss(model, batch)
    logp = out.outputs.log_softmax(-1)
    soft = torch.full((8, 10), 0.2 / 10).scatter_(1, batch["labels"][:, None], 1 - 0.2 + 0.2 / 10)
    torch.testing.assert_close(out.loss, -(soft * logp).sum())
    model.eval()  # evaluation reports plain cross-entropy
    torch.testing.assert_close(task.loss(model, batch).loss, F.cross_entropy(model(batch["image"]),
                                                                           batch["labels"], reduction="sum"))


def test_config_rules(tmp_path):
    with pytest.raises(ConfigError, match="train.batch_size: Mixup/CutMix needs an even batch size, got 7"):
        make_task(tmp_path, train={"batch_size": 7}, mixup={"cutmix_alpha": 1.0})
    make_task(tmp_path, train={"batch_size": 7})  # odd is fine without mixing
    with pytest.raises(ConfigError, match=r"mixup.label_smoothing moved to loss.label_smoothing: write "
                                          r"`loss: \{label_smoothing: 0.1\}`"):
        make_task(tmp_path, mixup={"label_smoothing": 0.1})
    with pytest.raises(ConfigError, match=r"loss.label_smoothing \(1.0\) must be in \[0, 1\)"):
        make_task(tmp_path, loss={"label_smoothing": 1.0})
    with pytest.raises(ConfigError, match="inc1"):
        make_task(tmp_path, data={"auto_augment": "rand-m9-mstd0.5-inc1"})
    with pytest.raises(ConfigError, match=r"model.dim \(30\) must be divisible by model.num_heads \(4\)"):
        make_task(tmp_path, model={**TOY_MODEL, "dim": 30})
    assert check_auto_augment("rand-m9-mstd0.5") is None and check_auto_augment("original") is None
    assert "m < 2.5" in check_auto_augment("rand-m2")


def test_randaugment_and_erasing_pipeline_runs():
    torch.manual_seed(0)
    t = build_train_transform(32, *MEAN_STD["cifar10"], auto_augment="rand-m9-mstd0.5", re_prob=1.0, crop="rrc")
    out = t(Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)))
    assert out.shape == (3, 32, 32) and torch.isfinite(out).all()


# -- files on disk ----------------------------------------------------------------------
def test_imagefolder_with_a_corrupt_file(tmp_path, caplog):
    root = tmp_path / "data"
    for split, n in (("train", 3), ("val", 2)):
        write_pngs(root / split / "cat", n, seed=1)
        write_pngs(root / split / "dog", n, seed=2)
    bad = root / "train" / "dog" / "zz_bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    data = {"source": "imagefolder", "root": str(root), "img_size": 16, "on_bad_image": "skip"}
    task = make_task(tmp_path, data=data, model={**TOY_MODEL, "patch_size": 4})
    assert task.class_names == ["cat", "dog"]
    ds = task.build_dataset("train")
    with caplog.at_level(logging.WARNING):
        items = [ds[i] for i in range(len(ds))]
    assert len(items) == 7 and ds.base.num_bad == 1 and str(bad) in caplog.text
    assert [it["labels"] for it in items] == [0, 0, 0, 1, 1, 1, 0]  # the bad one replaced by the next (wraps)
    assert items[0]["image"].shape == (3, 16, 16)
    strict = make_task(tmp_path, data={**data, "on_bad_image": "error"}, model={**TOY_MODEL, "patch_size": 4})
    ds = strict.build_dataset("train")
    with pytest.raises(TkError, match="zz_bad.png.*on_bad_image=skip"):
        [ds[i] for i in range(len(ds))]


def test_imagefolder_missing_or_empty(tmp_path):
    with pytest.raises(TkError, match=r"no folder .*nowhere.*train"):
        make_task(tmp_path, data={"source": "imagefolder", "root": str(tmp_path / "nowhere")}).setup()
    (tmp_path / "empty" / "train" / "cat").mkdir(parents=True)
    with pytest.raises(TkError, match="no images found"):
        make_task(tmp_path, data={"source": "imagefolder", "root": str(tmp_path / "empty")}).setup()


def _write_fake_cifar10(root, rng):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 255, (4, 3 * 32 * 32), dtype=np.uint8)
        labels = rng.integers(0, 10, 4).tolist()
        batches[name] = (data, labels)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                     "ship", "truck"]}, f)
    return batches


def test_cifar10_reader_on_a_fake_batch(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    batches = _write_fake_cifar10(tmp_path / "c", np.random.default_rng(0))
    # the fake files cannot match the real md5 sums: skip only torchvision's checksum test
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kw: True)
    task = make_task(tmp_path, data={"source": "cifar10", "root": str(tmp_path / "c"), "download": False})
    train, val = task.build_dataset("train"), task.build_dataset("val")
    assert len(train) == 20 and len(val) == 4
    data, labels = batches["test_batch"]
    item = val[1]
    assert item["labels"] == labels[1]
    mean, std = (torch.tensor(v)[:, None, None] for v in MEAN_STD["cifar10"])
    expected = (torch.from_numpy(data[1].reshape(3, 32, 32)).float() / 255 - mean) / std  # CHW rows in the file
    torch.testing.assert_close(item["image"], expected)
    assert task.class_names[3] == "cat"


def test_cifar_missing_and_download_failure(tmp_path, monkeypatch):
    import torchvision.datasets as tv

    task = make_task(tmp_path, data={"source": "cifar10", "root": str(tmp_path / "none"), "download": False})
    with pytest.raises(TkError, match=r"cifar10 not found .*cifar-10-batches-py.*data.download=true"):
        task.build_dataset("train")

    def offline(self):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(tv.CIFAR100, "download", offline)
    task = make_task(tmp_path, data={"source": "cifar100", "root": str(tmp_path / "none")})
    with pytest.raises(TkError, match=r"downloading cifar100 .* failed.*data.source=synthetic"):
        task.setup()


# -- models, metrics, prediction ---------------------------------------------------------
def test_timm_model_path_builds(tmp_path):
    torch.manual_seed(0)
    task = make_task(tmp_path, data={"num_train": 8}, model={"timm": "resnet18"})
    model = task.build_model()
    assert type(model).__name__ == "ResNet"
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(TkError, match="not a timm model"):
        make_task(tmp_path, model={"timm": "resnet_does_not_exist"}).build_model()


def test_confusion_matrix_metric_writes_table_and_png(tmp_path):
    from tk.core.step import EvalContext
    from tk.core.task import StepOutput

    metric = ConfusionMatrix(["a", "b", "c"])
    logits = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [3.0, 0, 0], [0, 0, 3.0]])
    metric.update(StepOutput(torch.zeros(()), 4, outputs=logits), {"labels": torch.tensor([0, 1, 1, 2])})
    assert metric.matrix.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    result = metric.compute()
    assert result["mean_class_acc"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert not (tmp_path / "eval").exists()  # compute writes nothing: the engine calls write on rank 0
    metric.write(tmp_path / "eval", EvalContext("val"))
    table = (tmp_path / "eval" / "val_per_class.tsv").read_text().splitlines()
    assert table[2] == "b\t2\t1\t0.5000"
    assert (tmp_path / "eval" / "val_confusion.png").read_bytes()[:4] == b"\x89PNG"


def test_predict_and_class_names_round_trip(tmp_path):
    torch.manual_seed(0)
    task = make_task(tmp_path, data={"num_train": 8})
    model = task.build_model()
    paths = []
    for i in range(2):
        img, _ = SyntheticShapes(4, seed=5)[i]
        img.save(tmp_path / f"img{i}.png")
        paths.append(str(tmp_path / f"img{i}.png"))
    state = task.state_dict()
    restored = make_task(tmp_path, data={"num_train": 8}, predict={"top_k": 3})
    restored.load_state_dict({"class_names": [f"c{i}" for i in range(10)]})
    assert restored.class_names[0] == "c0"
    restored.load_state_dict(state)
    preds = restored.predict(model, paths)
    assert [p["input"] for p in preds] == paths
    top = preds[0]["top_k"]
    assert len(top) == 3 and all(t["label"] in task.class_names for t in top)
    assert top[0]["prob"] >= top[1]["prob"] >= top[2]["prob"]
    with torch.no_grad():
        probs = model(task.collate([task._transform(False)(Image.open(paths[0]).convert("RGB"))])).softmax(-1)
    assert top[0]["prob"] == pytest.approx(probs.max().item(), abs=1e-6)
    missing = str(tmp_path / "missing.png")
    [bad, good] = restored.predict(model, [missing, paths[0]])  # a bad file costs only its own result
    assert bad["input"] == missing and bad["error"].startswith(f"cannot read image {missing}: ")
    # the same image in a batch of one: the same labels, probabilities up to GEMM rounding
    # (a batch of 1 and of 2 take different kernel paths on some CPUs)
    assert [t["label"] for t in good["top_k"]] == [t["label"] for t in top]
    assert [t["prob"] for t in good["top_k"]] == pytest.approx([t["prob"] for t in top], abs=1e-6)


@pytest.mark.slow
def test_quickstart_learns(tmp_path):
    """A shortened quickstart through `tk run`, then `tk predict`'s path on the run dir."""
    from click.testing import CliRunner

    from tk.core.cli import cli
    from tk.core.engine.inference import load_run

    run_dir = tmp_path / "run"
    args = ["run", "quickstart", f"output_dir={run_dir}", "train.max_steps=250", "train.batch_size=32",
            "data.num_val=500", "train.progress=false", "train.seed=0"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    top1 = [m["val/top1"] for m in metrics if "val/top1" in m][-1]
    assert top1 > 0.3, f"quickstart top-1 {top1:.3f} is not well above chance (0.1)"
    assert (run_dir / "eval" / "val_confusion.png").is_file()

    task, model = load_run(run_dir, "last", ["predict.top_k=2"])
    img, label = SyntheticShapes(1, split="test", seed=3)[0]
    img.save(tmp_path / "shape.png")
    [pred] = task.predict(model, [str(tmp_path / "shape.png")])
    assert task.class_names == list(SyntheticShapes.classes) and len(pred["top_k"]) == 2
