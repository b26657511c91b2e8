"""Image datasets of the plugin: synthetic shapes, CIFAR-10/100, image folders, ``datasets``
datasets and WebDataset shards (:mod:`.sources`); the ``data:`` section and its checks.

Every dataset yields ``{"image": (3, H, W) float tensor, "labels": int}`` items.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset
from torchvision import datasets

from tk.core.errors import TkError
from tk.plugins.image_classification.device_randaugment import parse_rand_augment
from tk.plugins.image_classification.transforms import check_auto_augment
from tk.plugins.image_classification.sources import HubImages, TarShards, expand_shards
from tk.plugins.image_classification.synthetic import SyntheticShapes

log = logging.getLogger(__name__)

# Per-dataset channel statistics (0-1 scale), as published with each set.
MEAN_STD: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "synthetic": ((0.5, 0.5, 0.5), (0.29, 0.29, 0.29)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    "hf": (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    "webdataset": (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
}
HF_SPLIT = {"train": "train", "val": "validation", "test": "test"}  # tk split -> the usual hub split names
SPLITS = ("train", "val", "test")
_CIFAR = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "cifar10", "cifar100", "imagefolder", "hf", "webdataset"] = "synthetic"  # which dataset
    root: str = "~/.cache/tk/data"  # dataset folder (cifar: download target; imagefolder: has train/ val/)
    download: bool = True  # cifar: download into `root` when missing
    img_size: int = 32  # model input side in pixels (images are resized/cropped to it)
    num_train: int = 5000  # synthetic: training images (generated on the fly)
    num_val: int = 1000  # synthetic: validation images
    seed: int = 0  # synthetic: seed of the image set (independent of train.seed)
    crop: Literal["pad", "rrc", "none"] = "pad"  # train crop: pad+random crop, RandomResizedCrop, centre
    crop_padding: int = 4  # "pad" crop: pixels of zero padding on each side
    rrc_scale_min: float = 0.08  # "rrc" crop: smallest crop area, as a fraction of the image
    crop_pct: float | None = None  # eval: resize to img_size / crop_pct, centre-crop img_size; null: timm's pretrained cfg when fine-tuning with crop rrc, else 1
    interpolation: Literal["bilinear", "bicubic", "nearest"] | None = None  # resize filter; null: timm's pretrained cfg when fine-tuning, else bilinear
    hflip: float = 0.5  # probability of a horizontal flip (train)
    auto_augment: str | None = None  # timm policy, e.g. "rand-m9-mstd0.5" (RandAugment); null = off
    re_prob: float = 0.0  # random-erasing probability per training image
    on_bad_image: Literal["skip", "error"] = "error"  # imagefolder, indexed webdataset: unreadable image -> skip (warn) or fail
    mean: list[float] | None = None  # input normalisation; null: timm's pretrained cfg when fine-tuning, else the source's
    std: list[float] | None = None  # (same, for the standard deviation)
    hf_name: str | None = None  # hf: a datasets hub id (e.g. "ethz/food101"), a save_to_disk folder, or a builder ("parquet", "imagefolder") with hf_data_files
    hf_config: str | None = None  # hf: the dataset's config; null = its default
    hf_split: dict[str, str] = field(default_factory=lambda: dict(HF_SPLIT))  # hf: tk split -> dataset split
    hf_data_files: dict[str, Any] | None = None  # hf: dataset split -> local file(s) for a builder, e.g. {train: train.parquet}
    image_column: str = "image"  # hf: the column holding the images (a datasets Image feature)
    label_column: str = "label"  # hf: the column holding the integer labels (a ClassLabel gives the class names)
    shards: dict[str, Any] | None = None  # webdataset: tk split -> .tar shards (local; any fsspec URL with streaming), a brace pattern or a list, e.g. {train: "d/train-{0000..0009}.tar"}
    streaming: bool = False  # hf/webdataset: read the samples in order as they come (remote shards, a streamed hub split) instead of by random access; resumes at the batch
    shuffle_buffer: int = 1000  # streaming: samples shuffled together in training (one buffer of raw samples per loader worker)
    pipeline: Literal["workers", "device"] = "workers"  # augment per image with PIL in loader workers, or decode the split once into memory and crop/flip/RandAugment/erase per sample in batch on the training device (in-memory sets; a GPU's pace)
    class_names: list[str] | None = None  # hf/webdataset: the label names in order; null: the ClassLabel's names (hf) or "0", "1", ... (webdataset)


def check_data(data: DataConfig) -> list[str]:
    """Range and cross-key checks of the ``data:`` section, one message per problem."""
    problems = []
    if data.source == "synthetic" and min(data.num_train, data.num_val) < 1:
        problems.append(f"data.num_train ({data.num_train}) and data.num_val ({data.num_val}) must be >= 1")
    for key in ("mean", "std"):
        if getattr(data, key) is not None and len(getattr(data, key)) != 3:
            problems.append(f"data.{key} ({getattr(data, key)}) must have 3 values (R, G, B)")
    if data.img_size < 1:
        problems.append(f"data.img_size ({data.img_size}) must be >= 1")
    if data.crop_pct is not None and not 0.0 < data.crop_pct <= 1.0:
        problems.append(f"data.crop_pct ({data.crop_pct}) must be in (0, 1]")
    if not 0.0 < data.rrc_scale_min <= 1.0:
        problems.append(f"data.rrc_scale_min ({data.rrc_scale_min}) must be in (0, 1]")
    for key in ("hflip", "re_prob"):
        if not 0.0 <= getattr(data, key) <= 1.0:
            problems.append(f"data.{key} ({getattr(data, key)}) must be in [0, 1]")
    if data.source == "hf" and not data.hf_name:
        problems.append("data.hf_name: data.source hf needs a dataset: a hub id (e.g. ethz/food101), a save_to_disk "
                        "folder, or a builder (parquet, imagefolder) with data.hf_data_files")
    for key, mapping in (("hf_split", data.hf_split), ("shards", data.shards or {})):
        if set(mapping) - set(SPLITS):
            problems.append(f"data.{key}: keys {sorted(set(mapping) - set(SPLITS))} are not tk splits; use "
                            f"{', '.join(SPLITS)}")
    if data.source == "webdataset" and not {"train", "val"} <= set(data.shards or {}):
        problems.append("data.shards: data.source webdataset needs the train and val shards, e.g. "
                        "{train: d/train-{0000..0009}.tar, val: d/val-0000.tar}")
    if data.streaming and data.source not in ("hf", "webdataset"):
        problems.append(f"data.streaming: data.source {data.source} is read by random access; streaming is for "
                        f"data.source hf or webdataset (or set data.streaming=false)")
    if data.shuffle_buffer < 1:
        problems.append(f"data.shuffle_buffer ({data.shuffle_buffer}) must be >= 1")
    if data.pipeline == "device":
        problems += _device_pipeline_problems(data)
    if data.class_names is not None and len(set(data.class_names)) != len(data.class_names):
        problems.append(f"data.class_names: names repeat ({data.class_names[:10]}); give each label its own name")
    return problems


def _device_pipeline_problems(data: DataConfig) -> list[str]:
    """What ``data.pipeline: device`` cannot do: it holds the split in memory at its stored size
    and runs RandAugment strings only (AutoAugment policies are PIL-only)."""
    problems = []
    if data.streaming:
        problems.append("data.pipeline: device holds the decoded split in memory; a streamed split is not; set "
                        "data.pipeline=workers or data.streaming=false")
    if data.auto_augment and check_auto_augment(data.auto_augment) is None:  # else refused for every pipeline
        try:
            parse_rand_augment(data.auto_augment)
        except ValueError as e:
            problems.append(f"data.auto_augment: {e}")
    if data.crop == "rrc":
        problems.append("data.crop: rrc crops the full-resolution image, which data.pipeline=device does not keep; "
                        "use data.crop=pad or none, or data.pipeline=workers")
    return problems


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
    if cfg.source == "hf":
        if split not in cfg.hf_split:
            raise TkError(f"data.hf_split: no dataset split for tk's {split!r} split ({cfg.hf_split}); add "
                          f"{split}: <split name>")
        return HubImages(cfg.hf_name, cfg.hf_config, cfg.hf_split[split], cfg.image_column, cfg.label_column,
                         cfg.hf_data_files, cfg.class_names, transform)
    if cfg.source == "webdataset":
        if split not in (cfg.shards or {}):
            raise TkError(f"data.shards: no shards for the {split!r} split; add {split}: <shards>")
        return TarShards(expand_shards(cfg.shards[split], f"data.shards.{split}"), f"data.shards.{split}",
                         cfg.class_names, transform, cfg.on_bad_image)
    raise TkError(f"data.source {cfg.source!r} must be one of {sorted(MEAN_STD)}")


def check_not_empty(dataset: Dataset, source: str, split: str) -> None:
    """Raise a TkError for a dataset with no items."""
    if len(dataset) == 0:
        raise TkError(f"data.source={source}: the {split!r} split has no images; check data.root and the files")


def counted(ds: Any, split: str, report: Any) -> Any:
    """``ds``, said in train.log and on the console with its size (and classes, where it knows them):
    how many images each split holds when an image run starts."""
    classes = getattr(ds, "classes", None) or getattr(getattr(ds, "base", None), "classes", None)
    report(f"image_classification: {split}: {len(ds):,} images" + (f" in {len(classes)} classes" if classes else ""))
    return ds
