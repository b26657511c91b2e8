"""The ``image_classification`` task: data, augmentation, Mixup/CutMix, ViT or timm model, metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Sequence

import timm
import torch
from torch import nn
from torch.utils.data import Dataset

from tk.core.config import did_you_mean
from tk.core.errors import TkError
from tk.core.metrics import Accuracy, Metric
from tk.core.task import StepOutput, Task
from tk.plugins.image_classification.data import MEAN_STD, DictDataset, build_source_dataset, check_not_empty
from tk.plugins.image_classification.metrics import ConfusionMatrix
from tk.plugins.image_classification.mixup import MixupConfig, build_mixup, check_mixup, classification_loss
from tk.plugins.image_classification.model import ModelConfig, build_classifier, check_model
from tk.plugins.image_classification.synthetic import CLASS_NAMES as SYNTHETIC_CLASSES
from tk.plugins.image_classification.transforms import (
    build_eval_transform,
    build_train_transform,
    check_auto_augment,
)

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "cifar10", "cifar100", "imagefolder"] = "synthetic"  # which dataset
    root: str = "~/.cache/tk/data"  # dataset folder (cifar: download target; imagefolder: has train/ val/)
    download: bool = True  # cifar: download into `root` when missing
    img_size: int = 32  # model input side in pixels (images are resized/cropped to it)
    num_train: int = 5000  # synthetic: training images (generated on the fly)
    num_val: int = 1000  # synthetic: validation images
    seed: int = 0  # synthetic: seed of the image set (independent of train.seed)
    crop: Literal["pad", "rrc", "none"] = "pad"  # train crop: pad+random crop, RandomResizedCrop, centre
    crop_padding: int = 4  # "pad" crop: pixels of zero padding on each side
    rrc_scale_min: float = 0.08  # "rrc" crop: smallest crop area, as a fraction of the image
    crop_pct: float = 1.0  # eval: resize to img_size / crop_pct, then centre-crop img_size
    hflip: float = 0.5  # probability of a horizontal flip (train)
    auto_augment: str | None = None  # timm policy, e.g. "rand-m9-mstd0.5" (RandAugment); null = off
    re_prob: float = 0.0  # random-erasing probability per training image
    on_bad_image: Literal["skip", "error"] = "error"  # imagefolder: unreadable file -> skip (warn) or fail


class ImageClassificationTask(Task):
    """Image classification: ViT or timm models on synthetic shapes, CIFAR-10/100 or image folders."""

    name: ClassVar[str] = "image_classification"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"mixup": MixupConfig}

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.mixup_cfg: MixupConfig = self.sections.get("mixup") or MixupConfig()
        self.run_dir: str | None = getattr(cfg, "output_dir", None)
        self._class_names: list[str] | None = None
        self._mixup: Any = None

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        data: DataConfig = cfg.sections["data"]
        problems = check_model(cfg.sections["model"], data.img_size)
        timm_name = cfg.sections["model"].timm
        if timm_name is not None and not timm.is_model(timm_name):  # tk validate catches it, not build_model
            problems.append(f"model.timm: {timm_name!r} is not a timm model{did_you_mean(timm_name, timm.list_models())}"
                            f" (see timm.list_models())")
        problems += check_mixup(cfg.sections.get("mixup") or MixupConfig(), cfg.train.batch_size)
        policy_problem = check_auto_augment(data.auto_augment)
        if policy_problem:
            problems.append(f"data.auto_augment: {policy_problem}")
        if data.source == "synthetic" and min(data.num_train, data.num_val) < 1:
            problems.append(f"data.num_train ({data.num_train}) and data.num_val ({data.num_val}) must be >= 1")
        if data.img_size < 1:
            problems.append(f"data.img_size ({data.img_size}) must be >= 1")
        if not 0.0 < data.crop_pct <= 1.0:
            problems.append(f"data.crop_pct ({data.crop_pct}) must be in (0, 1]")
        if not 0.0 < data.rrc_scale_min <= 1.0:
            problems.append(f"data.rrc_scale_min ({data.rrc_scale_min}) must be in (0, 1]")
        for key in ("hflip", "re_prob"):
            if not 0.0 <= getattr(data, key) <= 1.0:
                problems.append(f"data.{key} ({getattr(data, key)}) must be in [0, 1]")
        return problems

    # -- state -----------------------------------------------------------------------
    def setup(self, run_dir: str | None) -> None:
        if run_dir is not None:
            self.run_dir = run_dir
        self.class_names  # resolve now: fails early when the data is missing

    @property
    def class_names(self) -> list[str]:
        """Class names in label order (from the checkpoint, or read from the data)."""
        if self._class_names is None:
            if self.data.source == "synthetic":
                self._class_names = list(SYNTHETIC_CLASSES)
            elif self.data.source == "cifar10":
                self._class_names = list(CIFAR10_CLASSES)
            else:  # cifar100 reads its meta file; imagefolder its train/ sub-folders
                self._class_names = list(build_source_dataset(self.data, "train", None).classes)
        return self._class_names

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def state_dict(self) -> dict[str, Any]:
        return {"class_names": list(self.class_names)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "class_names" in state:
            self._class_names = list(state["class_names"])

    # -- data ------------------------------------------------------------------------
    def _transform(self, training: bool):
        d = self.data
        mean, std = MEAN_STD[d.source]
        if not training:
            return build_eval_transform(d.img_size, mean, std, d.crop_pct)
        return build_train_transform(
            d.img_size, mean, std, crop=d.crop, crop_padding=d.crop_padding, rrc_scale_min=d.rrc_scale_min,
            hflip=d.hflip, auto_augment=d.auto_augment, re_prob=d.re_prob,
        )

    def build_dataset(self, split: str) -> Dataset:
        """``{"image": (3, H, W) float, "labels": int}`` items of ``split``.

        CIFAR's ``"val"`` is its official test set (CIFAR has no validation split).
        """
        base = build_source_dataset(self.data, split, self._transform(split == "train"))
        check_not_empty(base, self.data.source, split)
        classes = getattr(base, "classes", None)
        if classes is not None and self._class_names is not None and list(classes) != self._class_names:
            raise TkError(f"the {split!r} split has classes {list(classes)[:10]}... but the model was built for "
                          f"{self._class_names[:10]}...; every split needs the same class folders")
        return DictDataset(base)

    def transform_batch(self, batch: dict[str, Any], training: bool) -> dict[str, Any]:
        """Mixup/CutMix in training (labels become (B, C) soft targets); identity otherwise."""
        if not training or not self.mixup_cfg.enabled:
            return batch
        if self._mixup is None:
            self._mixup = build_mixup(self.mixup_cfg, self.num_classes)
        images, labels = batch["image"], batch["labels"]
        if images.shape[0] % 2:
            raise TkError(f"Mixup/CutMix needs an even batch, got {images.shape[0]}; set an even "
                          f"train.batch_size (and keep drop_last for training)")
        images, targets = self._mixup(images.clone(), labels)  # timm mixes in place
        return {**batch, "image": images, "labels": targets}

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_classifier(self.model_cfg, self.num_classes, self.data.img_size)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Cross-entropy summed over the batch; SoftTargetCrossEntropy for mixed targets."""
        logits = model(batch["image"])  # (B, C)
        smoothing = self.mixup_cfg.label_smoothing if model.training else 0.0
        loss = classification_loss(logits, batch["labels"], smoothing)
        return StepOutput(loss=loss, num_items=logits.shape[0], outputs=logits.detach())

    def build_metrics(self, split: str) -> dict[str, Metric]:
        topk = (1, 5) if self.num_classes >= 5 else (1,)
        out_dir = os.path.join(self.run_dir, "eval") if self.run_dir else None
        return {"accuracy": Accuracy(topk=topk), "per_class": ConfusionMatrix(self.class_names, out_dir, split)}

    # -- inference ---------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: Sequence[str], top_k: int = 5, **options: Any) -> list[dict[str, Any]]:
        """Top-k classes of image files.

        Args:
            model: the trained classifier.
            inputs: image file paths.
            top_k: classes returned per image (capped at the number of classes).

        Returns:
            One dict per input: ``{"input": path, "top_k": [{"label": name, "prob": p}, ...]}``,
            most likely first.

        Raises:
            TkError: an input cannot be read as an image.
        """
        from PIL import Image

        transform = self._transform(training=False)
        images = []
        for path in inputs:
            try:
                with Image.open(path) as img:
                    images.append(transform(img.convert("RGB")))
            except (OSError, ValueError) as e:
                raise TkError(f"cannot read image {path}: {e}") from e
        if not images:
            return []
        device = next(model.parameters()).device
        model.eval()
        probs = model(torch.stack(images).to(device)).float().softmax(-1)  # (B, C)
        values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        return [
            {"input": path, "top_k": [{"label": self.class_names[i], "prob": p}
                                      for i, p in zip(idx.tolist(), val.tolist())]}
            for path, idx, val in zip(inputs, indices, values)
        ]
