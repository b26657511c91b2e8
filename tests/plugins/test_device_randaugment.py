"""RandAugment on the device (``data.pipeline: device`` with ``data.auto_augment``): every op against
timm's PIL op at the same magnitude, the per-sample draws against timm's distribution, and the
policy strings it takes and refuses."""

from __future__ import annotations

import numpy as np
import pytest
import timm.data.auto_augment as timm_aa
import torch
from PIL import Image

from tk.plugins.image_classification import device_randaugment as aug
from tk.plugins.image_classification.synthetic import SyntheticShapes

FILL = (125, 123, 114)


@pytest.fixture(scope="module")
def pictures() -> tuple[list[Image.Image], torch.Tensor]:
    """16 textured 32 px images (shapes with noise: every op changes them) as PIL and as a float batch."""
    rng = np.random.default_rng(0)
    images = []
    for i in range(16):
        pixels = np.asarray(SyntheticShapes(16, seed=i)[i][0], dtype=np.int16) + rng.integers(-40, 40, (32, 32, 3))
        images.append(Image.fromarray(pixels.clip(0, 255).astype(np.uint8)))
    batch = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in images]).float()
    return images, batch


@pytest.mark.parametrize("name", aug.RAND_OPS)
@pytest.mark.parametrize("magnitude", [3.0, 9.0])
def test_each_op_does_what_timms_pil_op_does(pictures, name, magnitude, monkeypatch):
    images, batch = pictures
    args = timm_aa.LEVEL_TO_ARG[name](magnitude, {"translate_pct": 0.45}) if timm_aa.LEVEL_TO_ARG[name] else ()
    level = torch.full((len(images),), magnitude)
    if name in aug.GEOMETRIC_OPS:  # one sign for both (timm negates half of the draws)
        monkeypatch.setattr(aug, "_signed", lambda value: value)
        args = (abs(args[0]),)
        ours = aug.GEOMETRIC_OPS[name](batch, level, torch.tensor(FILL, dtype=torch.float32))
    else:
        ours = aug.COLOR_OPS[name](batch, level)
    theirs = torch.stack([torch.from_numpy(np.array(timm_aa.NAME_TO_OP[name](im, *args, fillcolor=FILL,
                                                                             resample=Image.BILINEAR)))
                          for im in images]).permute(0, 3, 1, 2).float()
    effect = (theirs - batch).abs().mean()
    error = (ours - theirs).abs()
    assert torch.equal(ours, ours.round()) and ours.min() >= 0 and ours.max() <= 255  # whole numbers, as uint8
    if name in aug.GEOMETRIC_OPS:  # bilinear sampling: PIL and grid_sample differ at the borders only
        assert error.mean() < min(1.5, 0.1 * effect), (error.mean(), effect)
    else:  # the same arithmetic; PIL's fixed-point rounding is off by one at most
        assert error.max() <= 1 and error.mean() < 0.6 and effect > 1.0, (error.mean(), effect)


def test_ops_magnitudes_and_signs_are_drawn_per_sample_as_timm_draws_them():
    torch.manual_seed(0)
    spec = aug.parse_rand_augment("rand-m9-mstd0.5")
    ops, applied, magnitude = aug.BatchRandAugment(spec, FILL).draw(30000, torch.device("cpu"))
    assert ops.shape == (2, 30000)  # two layers per image
    counts = np.bincount(ops.flatten().numpy(), minlength=15)
    expected = ops.numel() / 15
    assert ((counts - expected) ** 2 / expected).sum() < 36.12  # uniform over the 15 ops (chi-square, p = 0.001)
    assert abs(applied.float().mean() - 0.5) < 0.01  # p = 0.5
    assert abs(magnitude.mean() - 9.0) < 0.02 and abs(magnitude.std() - 0.5) < 0.02 and magnitude.max() <= 10
    signs = aug._signed(torch.ones(20000))
    assert abs(signs.mean()) < 0.03


def test_a_batch_is_augmented_per_image_and_fixed_by_the_seed(pictures):
    _, batch = pictures
    images = batch[:1].repeat(64, 1, 1, 1).to(torch.uint8)
    rand_augment = aug.BatchRandAugment(aug.parse_rand_augment("rand-m9-mstd0.5"), FILL)
    torch.manual_seed(1)
    a = rand_augment(images)
    torch.manual_seed(1)
    assert torch.equal(a, rand_augment(images)) and a.dtype == torch.uint8
    assert len({x.numpy().tobytes() for x in a}) > 20  # one image, many different results
    assert (a == images).flatten(1).all(1).float().mean() > 0.15  # ~25% draw no op in either layer


@pytest.mark.parametrize("policy, spec", [
    ("rand-m9-mstd0.5", aug.RandAugmentSpec(magnitude=9, magnitude_std=0.5)),
    ("rand-m7-n3-p0.7-mmax12", aug.RandAugmentSpec(magnitude=7, num_layers=3, prob=0.7, magnitude_max=12)),
])
def test_policy_strings(policy, spec):
    assert aug.parse_rand_augment(policy) == spec


@pytest.mark.parametrize("policy", ["original", "rand-m9-w0", "rand-m9-inc1"])
def test_what_only_the_pil_path_has_is_refused(policy):
    with pytest.raises(ValueError, match="data.pipeline=workers"):
        aug.parse_rand_augment(policy)
