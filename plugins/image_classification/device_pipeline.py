"""``data.pipeline: device``: images decoded once into a uint8 tensor, augmented in batch on the
training device.

The worker path runs PIL per image in loader processes (crop, flip, ToTensor, Normalize,
random erasing); on a GPU that trains a small ViT at tens of thousands of images per second
those workers cannot keep up. Here a split is decoded once (resized and centre-cropped to
its stored size, the eval transform's geometry for evaluation), the loader only gathers
rows of that tensor, and :class:`BatchAugment` applies the same augmentations per sample,
vectorised over the batch, on whatever device the batch is on (airbench's approach).

Distributions match the worker path's: timm's RandAugment drawn per sample
(:mod:`.device_randaugment`), pad-and-crop offsets uniform in ``[0, 2p]`` per
axis (torchvision ``RandomCrop(padding=p)``), a flip with probability ``hflip``, and timm's
``RandomErasing`` (``mode="pixel"``: area fraction uniform in [0.02, 1/3], log aspect ratio
uniform in [log 0.3, log 1/0.3], up to 10 tries to fit, position uniform, N(0, 1) noise
after normalisation). Random numbers come from the device's global generator, which
checkpoints save and resume restores, like Mixup's.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

from tk.core.errors import TkError
from tk.plugins.image_classification.data import build_source_dataset, check_not_empty
from tk.plugins.image_classification.device_randaugment import BatchRandAugment, parse_rand_augment

log = logging.getLogger(__name__)

ERASE_AREA = (0.02, 1 / 3)  # timm RandomErasing defaults: fraction of the image erased
ERASE_LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))
ERASE_TRIES = 10


def stored_transform(img_size: int, interpolation: str, crop_pct: float = 1.0):
    """PIL image -> (3, S, S) uint8: the geometry every stored image gets once. Training stores
    ``Resize(S) + CenterCrop(S)`` (``crop_pct`` 1); evaluation the eval transform's resize
    to ``S / crop_pct`` and centre crop, so its batches equal the worker path's bit for bit."""
    mode = T.InterpolationMode(interpolation)
    return T.Compose([T.Resize(int(round(img_size / crop_pct)), interpolation=mode), T.CenterCrop(img_size),
                      T.PILToTensor()])


class DecodedImages(Dataset):
    """A split held as one uint8 tensor ``images`` (N, 3, S, S) and int64 ``labels`` (N,).

    The loader fetches a whole batch at once (``__getitems__``: one gather, no per-image
    Python); pass :func:`stacked` as its ``collate_fn``.
    """

    def __init__(self, images: Tensor, labels: Tensor, classes: Sequence[str] | None = None) -> None:
        self.images, self.labels = images, labels
        if classes is not None:
            self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "labels": self.labels[index]}

    def __getitems__(self, indices: list[int]) -> dict[str, Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return {"image": self.images.index_select(0, index), "labels": self.labels.index_select(0, index)}


def stacked(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The collate of :class:`DecodedImages`: its batches come stacked already."""
    return batch


def decode_split(base: Dataset, num_workers: int = 0, what: str = "images") -> DecodedImages:
    """Read every ``(uint8 image, label)`` item of ``base`` once (with ``num_workers`` loader
    processes) into a :class:`DecodedImages`."""
    loader = DataLoader(base, batch_size=256, num_workers=num_workers)
    images, labels = [], []
    for image, label in loader:
        images.append(image)
        labels.append(torch.as_tensor(label, dtype=torch.long))
    decoded = DecodedImages(torch.cat(images), torch.cat(labels), getattr(base, "classes", None))
    log.info("decoded %d %s once into memory (%.0f MB uint8, data.pipeline=device)",
             len(decoded), what, decoded.images.numel() / 2**20)
    return decoded


def decoded_split(data: Any, data_config: dict[str, Any], split: str, num_workers: int = 0,
                  class_names: Sequence[str] | None = None) -> DecodedImages:
    """``split`` of ``data`` (a DataConfig) decoded once: training images at ``img_size``, evaluation
    ones through the eval geometry of ``data_config`` (``interpolation``, ``crop_pct``).

    Raises:
        TkError: the split is empty, or its classes are not ``class_names`` (the model's).
    """
    crop_pct = 1.0 if split == "train" else data_config["crop_pct"]
    base = build_source_dataset(data, split, stored_transform(data.img_size, data_config["interpolation"], crop_pct))
    check_not_empty(base, data.source, split)
    decoded = decode_split(base, num_workers, f"{split} images")
    classes = getattr(decoded, "classes", None)
    if class_names is not None and classes is not None and list(classes) != list(class_names):
        raise TkError(f"the {split!r} split has classes {classes[:10]}... but the model was built for "
                      f"{list(class_names)[:10]}...; every split needs the same class folders")
    return decoded


def random_crop(images: Tensor, padding: int) -> Tensor:
    """Each image zero-padded by ``padding`` and cropped back to its size at an offset uniform
    in ``[0, 2 * padding]`` per axis, drawn per image (torchvision ``RandomCrop(padding=)``)."""
    if padding <= 0:
        return images
    batch, channels, height, width = images.shape
    device = images.device
    padded = F.pad(images, (padding,) * 4)
    top = torch.randint(0, 2 * padding + 1, (batch,), device=device)
    left = torch.randint(0, 2 * padding + 1, (batch,), device=device)
    rows = (top[:, None] + torch.arange(height, device=device)).view(batch, 1, height, 1)
    cols = (left[:, None] + torch.arange(width, device=device)).view(batch, 1, 1, width)
    picked_rows = padded.gather(2, rows.expand(batch, channels, height, width + 2 * padding))
    return picked_rows.gather(3, cols.expand(batch, channels, height, width))  # two gathers beat one 4-D index


def random_flip(images: Tensor, prob: float) -> Tensor:
    """Each image mirrored left-right with probability ``prob``."""
    if prob <= 0:
        return images
    flip = torch.rand(images.shape[0], device=images.device) < prob
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def random_erasing(images: Tensor, prob: float) -> Tensor:
    """timm's ``RandomErasing(prob, mode="pixel")`` on every image of a normalised batch at once:
    with probability ``prob`` a rectangle (the first of 10 drawn shapes that fits) is filled
    with N(0, 1) noise."""
    if prob <= 0:
        return images
    batch, _, height, width = images.shape
    device = images.device
    area = (ERASE_AREA[0] + (ERASE_AREA[1] - ERASE_AREA[0]) * torch.rand(batch, ERASE_TRIES, device=device)) \
        * (height * width)
    aspect = torch.exp(ERASE_LOG_ASPECT[0] + (ERASE_LOG_ASPECT[1] - ERASE_LOG_ASPECT[0])
                       * torch.rand(batch, ERASE_TRIES, device=device))
    h = torch.round(torch.sqrt(area * aspect)).long()
    w = torch.round(torch.sqrt(area / aspect)).long()
    fits = (h < height) & (w < width)
    first = fits.int().argmax(dim=1, keepdim=True)  # the first try that fits (timm's loop)
    h, w = h.gather(1, first), w.gather(1, first)  # (B, 1)
    erase = (torch.rand(batch, device=device) < prob) & fits.any(dim=1)
    top = (torch.rand(batch, 1, device=device) * (height - h + 1)).long()  # randint(0, H - h)
    left = (torch.rand(batch, 1, device=device) * (width - w + 1)).long()
    rows = torch.arange(height, device=device)
    cols = torch.arange(width, device=device)
    in_rows = (rows >= top) & (rows < top + h)  # (B, H)
    in_cols = (cols >= left) & (cols < left + w)  # (B, W)
    mask = erase[:, None, None] & in_rows[:, :, None] & in_cols[:, None, :]
    return torch.where(mask[:, None], torch.randn_like(images), images)


class BatchAugment:
    """uint8 batches -> normalised float batches, augmented per sample in training, in the worker
    path's order: crop, flip, RandAugment, normalise, random erasing.

    Args:
        mean, std: per-channel normalisation (0-1 scale), as ``T.Normalize``.
        crop_padding: training pad-and-crop padding (0: no crop, ``data.crop: none``).
        hflip: flip probability; re_prob: random-erasing probability (training).
        auto_augment: a timm RandAugment string (``"rand-m9-mstd0.5"``; :mod:`.device_randaugment`), or None.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], crop_padding: int = 0, hflip: float = 0.0,
                 re_prob: float = 0.0, auto_augment: str | None = None) -> None:
        self.mean, self.std = list(mean), list(std)
        self.crop_padding, self.hflip, self.re_prob = crop_padding, hflip, re_prob
        fill = [round(255 * m) for m in self.mean]  # timm's img_mean: the fill of the geometric ops
        self.rand_augment = BatchRandAugment(parse_rand_augment(auto_augment), fill) if auto_augment else None

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, 3, H, W) -> float32, ``ToTensor`` then ``Normalize`` (the same operations, so
        the same bits)."""
        x = images.to(torch.float32).div(255)
        mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return x.sub_(mean).div_(std)

    def __call__(self, images: Tensor, training: bool) -> Tensor:
        # The engine calls this under the run's autocast: the geometric ops' grids and sharpness's
        # convolution must stay float32 to give the worker path's pixels.
        with torch.autocast(images.device.type, enabled=False):
            if not training:
                return self.normalize(images)
            images = random_flip(random_crop(images, self.crop_padding), self.hflip)
            if self.rand_augment is not None:
                images = self.rand_augment(images)
            return random_erasing(self.normalize(images), self.re_prob)
