"""Image datasets of the plugin: synthetic shapes, CIFAR-10/100 and image folders.

Every dataset yields ``{"image": (3, H, W) float tensor, "labels": int}`` items.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset
from torchvision import datasets

from tk.core.errors import TkError
from tk.plugins.image_classification.synthetic import SyntheticShapes

log = logging.getLogger(__name__)

# Per-dataset channel statistics (0-1 scale), as published with each set.
MEAN_STD: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "synthetic": ((0.5, 0.5, 0.5), (0.29, 0.29, 0.29)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
}
_CIFAR = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}


class DictDataset(Dataset):
    """Turns ``(image, label)`` pairs into the plugin's batch-item dicts."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image, label = self.base[index]
        return {"image": image, "labels": label}


class CheckedImageFolder(datasets.ImageFolder):
    """``ImageFolder`` that reports unreadable images by path.

    With ``on_bad_image="error"`` a bad file raises a ``TkError`` naming it; with
    ``"skip"`` it is logged once as a warning, counted in ``num_bad`` / ``bad_paths``
    (per process: each loader worker counts its own) and replaced by the next
    readable image, so batch shapes are unchanged.
    """

    def __init__(self, root: str, transform: Callable | None = None, on_bad_image: str = "error") -> None:
        super().__init__(root, transform=transform)
        if on_bad_image not in ("skip", "error"):
            raise ValueError(f"on_bad_image {on_bad_image!r} must be 'skip' or 'error'")
        self.on_bad_image = on_bad_image
        self.bad_paths: set[str] = set()

    def verify(self) -> None:
        """Check every file now (``Image.verify`` reads headers and structure, not pixels):
        a split read only at evaluation time then fails before training, not after it.
        Unreadable files raise or are dropped (and counted) as ``on_bad_image`` says."""
        readable = []
        for path, label in self.samples:
            try:
                with Image.open(path) as image:
                    image.verify()
            except Exception as e:  # PIL raises several types (OSError, SyntaxError, ValueError)
                if self.on_bad_image == "error":
                    raise TkError(f"cannot read image {path}: {e}. Fix or delete the file, "
                                  f"or set data.on_bad_image=skip to skip unreadable images") from e
                self.bad_paths.add(path)
                log.warning("skipping unreadable image %s (%s)", path, e)
                continue
            readable.append((path, label))
        if not readable:
            raise TkError(f"no readable image in {self.root}: all {len(self.samples)} files failed to load")
        self.samples = self.imgs = readable
        self.targets = [label for _, label in readable]

    @property
    def num_bad(self) -> int:
        return len(self.bad_paths)

    def __getitem__(self, index: int):
        for offset in range(len(self.samples)):
            path, label = self.samples[(index + offset) % len(self.samples)]
            try:
                image = self.loader(path)
            except Exception as e:  # PIL raises several types (OSError, SyntaxError, ValueError)
                if self.on_bad_image == "error":
                    raise TkError(f"cannot read image {path}: {e}. Fix or delete the file, "
                                  f"or set data.on_bad_image=skip to skip unreadable images") from e
                if path not in self.bad_paths:
                    self.bad_paths.add(path)
                    log.warning("skipping unreadable image %s (%s); %d skipped so far", path, e, self.num_bad)
                continue
            return (self.transform(image) if self.transform else image), label
        raise TkError(f"no readable image in {self.root}: all {len(self.samples)} files failed to load")


def expand_root(root: str) -> str:
    """``data.root`` with ``~`` and environment variables expanded."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(root)))


def build_cifar(source: str, root: str, train: bool, download: bool, transform: Callable | None) -> Dataset:
    """torchvision's CIFAR-10/100 reader, with errors that say where it looked.

    Raises:
        TkError: the files are missing (download off) or the download failed.
    """
    cls = _CIFAR[source]
    where = os.path.join(root, cls.base_folder)
    try:
        return cls(root, train=train, download=download, transform=transform)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
        raise TkError(f"{source} not found (or corrupted) in {where}: {e}. Set data.download=true to "
                      f"download it, or put the extracted '{cls.base_folder}' folder under data.root "
                      f"({root}); for an offline run use data.source=synthetic") from e
    except OSError as e:  # no network, DNS failure, HTTP errors (URLError is an OSError)
        raise TkError(f"downloading {source} into {root} failed ({e}). Check the network, or download "
                      f"{cls.url} yourself and extract it under data.root; for an offline run use "
                      f"data.source=synthetic") from e


def build_imagefolder(root: str, split: str, transform: Callable | None, on_bad_image: str) -> CheckedImageFolder:
    """``root/<split>/<class>/<image>`` as a dataset.

    Raises:
        TkError: the split folder is missing or holds no images.
    """
    folder = os.path.join(root, split)
    layout = f"expected {root}/train/<class>/<image> and {root}/val/<class>/<image>; set data.root"
    if not os.path.isdir(folder):
        raise TkError(f"imagefolder: no folder {folder}; {layout}")
    try:
        dataset = CheckedImageFolder(folder, transform=transform, on_bad_image=on_bad_image)
    except FileNotFoundError as e:  # torchvision: no class folders, or no image files in them
        raise TkError(f"imagefolder: no images found under {folder} ({e}); {layout}") from e
    return dataset


def build_source_dataset(cfg: Any, split: str, transform: Callable | None) -> Dataset:
    """The ``(image, label)`` dataset of ``split`` for ``cfg.source`` (a DataConfig).

    CIFAR has no validation split: ``"val"`` and ``"test"`` both read its test set.
    """
    if cfg.source == "synthetic":
        size = cfg.num_train if split == "train" else cfg.num_val
        return SyntheticShapes(size, split=split, seed=cfg.seed, transform=transform)
    root = expand_root(cfg.root)
    if cfg.source in _CIFAR:
        return build_cifar(cfg.source, root, split == "train", cfg.download, transform)
    if cfg.source == "imagefolder":
        dataset = build_imagefolder(root, split, transform, cfg.on_bad_image)
        if split != "train":  # read at evaluation only: check it before training starts
            dataset.verify()
        return dataset
    raise TkError(f"data.source {cfg.source!r} must be one of {sorted(MEAN_STD)}")


def check_not_empty(dataset: Dataset, source: str, split: str) -> None:
    """Raise a TkError for a dataset with no items."""
    if len(dataset) == 0:
        raise TkError(f"data.source={source}: the {split!r} split has no images; check data.root and the files")
