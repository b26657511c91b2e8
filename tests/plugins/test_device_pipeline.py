"""image_classification with ``data.pipeline: device`` (issue #38 item 3): a split decoded once into
uint8, cropped, flipped and erased per sample in batch where the batch is. Checked against the
worker path: evaluation batches bit for bit, training augmentations in distribution (crop offsets
and flips from marked pixels, erased areas against timm's RandomErasing), per-sample draws,
determinism under a seed, and a SIGKILLed run that resumes with every logged loss unchanged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from timm.data.random_erasing import RandomErasing
from torchvision import transforms as T

from tk.core.cli import cli
from tk.core.data import LoaderSpec
from tk.plugins.image_classification.device_pipeline import BatchAugment, random_crop, random_erasing, random_flip

from ..kill import kill_when
from .test_image_classification import make_task

TK = str(Path(sys.executable).with_name("tk"))
SIDE, PAD, DRAWS = 16, 4, 4000
CHI2_999 = {1: 10.83, 8: 26.12}  # chi-square critical values at p = 0.001 (degrees of freedom)


def chi2_uniform(values: np.ndarray, k: int) -> float:
    counts = np.bincount(values, minlength=k)
    expected = len(values) / k
    return float(((counts - expected) ** 2 / expected).sum())


def marked_image() -> np.ndarray:
    """(SIDE, SIDE, 3) uint8: red = row + 1, green = column + 1 (0 only in the padding)."""
    rows, cols = np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij")
    return np.stack([rows + 1, cols + 1, np.full_like(rows, 7)], axis=-1).astype(np.uint8)


def offsets(images: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top, left, flipped) of cropped + flipped marked images (N, 3, SIDE, SIDE), read at the centre."""
    c = SIDE // 2
    red, green, green_right = images[:, 0, c, c].astype(int), images[:, 1, c, c].astype(int), \
        images[:, 1, c, c + 1].astype(int)
    flipped = green_right < green
    top = red - 1 - c + PAD
    left = np.where(flipped, green - 1 - (SIDE - 1 - c) + PAD, green - 1 - c + PAD)
    return top, left, flipped.astype(int)


def test_crop_and_flip_draw_the_worker_paths_distribution_per_sample():
    image = marked_image()
    worker = T.Compose([T.RandomCrop(SIDE, padding=PAD), T.RandomHorizontalFlip(0.5), T.PILToTensor()])
    torch.manual_seed(0)
    from_workers = np.stack([worker(Image.fromarray(image)).numpy() for _ in range(DRAWS)])
    batch = torch.from_numpy(image).permute(2, 0, 1)[None].repeat(DRAWS, 1, 1, 1)
    torch.manual_seed(1)  # fixed draws: a test at p = 0.001 fails for one seed in a thousand
    on_device = random_flip(random_crop(batch, PAD), 0.5).numpy()
    for name, images in (("workers", from_workers), ("device", on_device)):
        top, left, flipped = offsets(images)
        assert top.min() == 0 and top.max() == 2 * PAD and left.min() == 0 and left.max() == 2 * PAD, name
        assert chi2_uniform(top, 2 * PAD + 1) < CHI2_999[8], name  # uniform offsets, as RandomCrop's
        assert chi2_uniform(left, 2 * PAD + 1) < CHI2_999[8], name
        assert chi2_uniform(flipped, 2) < CHI2_999[1], name
    # the device path really crops and flips (not one draw for the whole batch)
    assert len({tuple(x) for x in np.stack(offsets(on_device), axis=1)}) > 100


def erased_boxes(images: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(erased?, rows, cols) of each erased image of a batch that was all zeros."""
    hit = images[:, 0] != 0  # (N, H, W)
    return hit.flatten(1).any(1).numpy(), hit.any(2).sum(1).numpy(), hit.any(1).sum(1).numpy()


def test_random_erasing_erases_as_timm_does():
    torch.manual_seed(0)
    zeros = torch.zeros(DRAWS, 3, SIDE, 24)  # not square: the aspect ratio must land the same way
    timm_erasing = RandomErasing(0.25, mode="pixel", device="cpu")
    ours = erased_boxes(random_erasing(zeros.clone(), 0.25))
    theirs = erased_boxes(timm_erasing(zeros.clone()))
    rate_error = 4 * np.sqrt(0.25 * 0.75 / DRAWS) * np.sqrt(2)
    assert abs(ours[0].mean() - theirs[0].mean()) < rate_error
    for ours_side, theirs_side in ((ours[1], theirs[1]), (ours[2], theirs[2])):  # rows, then columns
        a, b = ours_side[ours[0]], theirs_side[theirs[0]]
        assert abs(a.mean() - b.mean()) < 4 * np.sqrt(a.var() / len(a) + b.var() / len(b))
        assert a.max() <= b.max() + 1 and a.min() >= b.min() - 1
    noise = random_erasing(zeros[:500].clone(), 1.0)
    values = noise[noise != 0]
    assert abs(values.mean()) < 0.05 and abs(values.std() - 1) < 0.05  # N(0, 1) pixels, as mode="pixel"


def test_the_augmentation_is_fixed_by_the_seed_and_drawn_per_sample():
    images = torch.randint(0, 256, (64, 3, SIDE, SIDE), dtype=torch.uint8)
    augment = BatchAugment([0.5] * 3, [0.25] * 3, crop_padding=PAD, hflip=0.5, re_prob=0.5)
    torch.manual_seed(3)
    a = augment(images, training=True)
    torch.manual_seed(3)
    b = augment(images, training=True)
    c = augment(images, training=True)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32 and a.shape == images.shape
    same = torch.stack([augment(images[:1].repeat(64, 1, 1, 1), training=True)]).squeeze(0)
    assert len({x.numpy().tobytes() for x in same}) > 32  # one image, many different views


def test_the_runs_bf16_autocast_leaves_the_augmentation_float32():
    # The engine calls transform_batch under autocast; RandAugment's grids and sharpness's
    # convolution then ran in bf16 and moved ~10% of the pixels (0.63 at most after normalising).
    images = torch.randint(0, 256, (64, 3, SIDE, SIDE), dtype=torch.uint8)
    augment = BatchAugment([0.5] * 3, [0.25] * 3, crop_padding=PAD, hflip=0.5, re_prob=0.25,
                           auto_augment="rand-m9-mstd0.5")
    torch.manual_seed(5)
    plain = augment(images, training=True)
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = augment(images, training=True)
    assert torch.equal(plain, under_autocast)


def loader_batches(task, split: str, n: int = 2) -> list[dict]:
    loader = task.build_loader(split, LoaderSpec(batch_size=8, shuffle=False, seed=0))
    return [task.transform_batch(batch, training=False) for _, batch in zip(range(n), loader)]


@pytest.mark.parametrize("source", ["synthetic", "imagefolder"])
def test_evaluation_batches_equal_the_worker_paths_bit_for_bit(tmp_path, source):
    data = {"source": "synthetic", "num_train": 16, "num_val": 16, "img_size": 16}
    if source == "imagefolder":  # non-square images of another size: the eval resize and centre crop
        for split in ("train", "val"):
            for label in ("a", "b"):
                folder = tmp_path / "images" / split / label
                folder.mkdir(parents=True)
                for i in range(4):
                    pixels = np.random.default_rng(i).integers(0, 255, (20 + i, 27, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(folder / f"{i}.png")
        data = {"source": "imagefolder", "root": str(tmp_path / "images"), "img_size": 16, "crop_pct": 0.875,
                "interpolation": "bicubic"}
    workers = loader_batches(make_task(tmp_path, data=data), "val")
    device = loader_batches(make_task(tmp_path, data={**data, "pipeline": "device"}), "val")
    for w, d in zip(workers, device):
        assert d["image"].dtype == torch.float32
        assert torch.equal(w["image"], d["image"]) and torch.equal(w["labels"], d["labels"])


@pytest.mark.parametrize("override, message", [
    (["data.auto_augment=original"], r"data.auto_augment: 'original': data.pipeline=device runs RandAugment strings"),
    (["data.auto_augment=rand-m9-inc1"], r"data.auto_augment"),
    (["data.crop=rrc"], r"data.crop: rrc .* data.pipeline=device does not keep"),
    (["data.pipeline=gpu"], r"data.pipeline"),
])
def test_what_the_device_pipeline_cannot_do_is_one_line_before_the_run(override, message):
    result = CliRunner().invoke(cli, ["validate", "quickstart", "data.pipeline=device", *override])
    assert result.exit_code == 2 and re.search(message, result.stderr), result.output
    assert len(result.stderr.strip().splitlines()) == 1


def records(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val/loss"), r.get("val/top1")) for r in rows]


@pytest.mark.slow
def test_a_sigkilled_device_pipeline_run_learns_and_resumes_exactly(tmp_path):
    """Crop, flip, RandAugment, erasing and Mixup/CutMix drawn on the batch's device: SIGKILL after step 8's
    checkpoint and --resume give every logged loss of the uninterrupted run, which learns."""
    args = ["quickstart", "data.pipeline=device", "data.num_train=2048", "data.num_val=256", "data.crop=pad",
            "data.re_prob=0.25", "data.auto_augment=rand-m9-mstd0.5", "mixup.mixup_alpha=0.8", "mixup.cutmix_alpha=1.0", "train.batch_size=32",
            "train.max_steps=40", "train.eval_every=20", "train.log_every=1", "train.progress=false",
            "train.num_workers=2"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    done = subprocess.run([TK, "run", *args, f"output_dir={ref}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kill_when([TK, "run", *args, f"output_dir={killed}", "train.save_every=1"],
              killed / "checkpoints" / "step_00000009.pt")
    resumed = subprocess.run([TK, "run", *args, f"output_dir={killed}", "--resume"], capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert records(killed) == records(ref) and len(records(ref)) >= 40
    assert records(ref)[-1][3] > 0.18  # top-1 after 40 mixed updates: 4 standard errors above chance (0.1)
