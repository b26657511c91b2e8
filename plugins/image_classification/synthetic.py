"""A procedurally generated 10-class image set ("shapes"): offline, no disk, seeded.

Each item is drawn on the fly from ``(seed, split, index)``, so the set costs no
storage, is identical on every machine and needs no download. The classes are
shapes and textures that stay distinct under random rotation (a rotated square
is not confusable with another class), drawn with random colours, position,
scale, rotation and pixel noise.
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

CLASS_NAMES = (
    "disk", "square", "triangle", "plus", "ring",
    "stripes", "checker", "crescent", "star", "frame",
)
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


def _shape_mask(label: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Boolean mask of class ``label`` in object coordinates (u, v), unit radius."""
    r = np.hypot(u, v)
    box = np.maximum(np.abs(u), np.abs(v))
    if label == 0:
        return r < 0.9
    if label == 1:
        return box < 0.75
    if label == 2:  # upward triangle: base at v = -0.6, apex at v = 0.9
        return (v > -0.6) & (np.abs(u) < (0.9 - v) * 0.6)
    if label == 3:
        return ((np.abs(u) < 0.25) & (np.abs(v) < 0.95)) | ((np.abs(v) < 0.25) & (np.abs(u) < 0.95))
    if label == 4:
        return (r > 0.55) & (r < 0.95)
    if label == 5:  # parallel bars inside the disk
        return (r < 0.95) & (np.sin(u * 3.0 * np.pi) > 0)
    if label == 6:
        return (box < 0.9) & (np.sin(u * 2.0 * np.pi) * np.sin(v * 2.0 * np.pi) > 0)
    if label == 7:
        return (r < 0.9) & (np.hypot(u - 0.45, v) > 0.7)
    if label == 8:  # five-pointed star in polar form
        return r < 0.45 + 0.45 * np.cos(5.0 * np.arctan2(v, u))
    if label == 9:
        return (box > 0.5) & (box < 0.9)
    raise ValueError(f"label ({label}) must be in [0, {len(CLASS_NAMES)})")


def render_shape(rng: np.random.Generator, label: int, size: int = 32) -> np.ndarray:
    """One image of class ``label`` as a (size, size, 3) uint8 array.

    Args:
        rng: the random source for colour, placement, rotation and noise.
        label: class index in ``[0, 10)``.
        size: image side in pixels.
    """
    radius = rng.uniform(0.3, 0.45) * size
    cx, cy = rng.uniform(radius * 0.8, size - radius * 0.8, size=2)
    angle = rng.uniform(0.0, 2.0 * np.pi)
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = (xs - cx) / radius, (ys - cy) / radius
    # rotate the sampling grid instead of the shape: same thing, one line
    u = np.cos(angle) * dx + np.sin(angle) * dy
    v = -np.sin(angle) * dx + np.cos(angle) * dy
    mask = _shape_mask(label, u, v)[..., None]
    # random colours, but the shape is always the lighter one: edges then have a fixed
    # sign, which a linear patch embedding picks up quickly
    bg = rng.uniform(0.0, 0.45, size=3)
    fg = rng.uniform(0.55, 1.0, size=3)
    img = np.where(mask, fg, bg) + rng.normal(0.0, 0.05, size=(size, size, 3))
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


class SyntheticShapes(Dataset):
    """``num_samples`` shape images of one split, labels balanced (``index % 10``).

    Items are ``(PIL.Image, label)`` pairs like torchvision's datasets, so the same
    transforms apply. The same ``(seed, split, index)`` always gives the same image.

    Args:
        num_samples: number of items.
        split: ``"train"``, ``"val"`` or ``"test"``; each has its own random stream.
        seed: base seed of the whole set (not the training seed).
        size: image side in pixels.
        transform: applied to the PIL image.
    """

    classes = list(CLASS_NAMES)

    def __init__(self, num_samples: int, split: str = "train", seed: int = 0, size: int = 32, transform=None) -> None:
        if num_samples < 1:
            raise ValueError(f"synthetic split {split!r} must have at least 1 image, got num_samples={num_samples}")
        if split not in _SPLIT_CODES:
            raise ValueError(f"split {split!r} is not one of {sorted(_SPLIT_CODES)}")
        self.num_samples, self.split, self.seed, self.size = num_samples, split, seed, size
        self.transform = transform

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        label = index % len(CLASS_NAMES)
        rng = np.random.default_rng([self.seed, _SPLIT_CODES[self.split], index])
        img = Image.fromarray(render_shape(rng, label, self.size))
        return (self.transform(img) if self.transform is not None else img), label
