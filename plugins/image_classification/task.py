"""The ``image_classification`` task: data, augmentation, Mixup/CutMix, ViT or timm model, metrics."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import timm
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tk.core.config import did_you_mean
from tk.core.data.loader import LoaderSpec, build_loader
from tk.core.distill import check_same_teacher
from tk.core.engine.inference import SourceRun, read_record, write_record
from tk.core.errors import TkError
from tk.core.losses import cross_entropy_sum
from tk.core.metrics import Accuracy, Metric
from tk.core.optim import OptimConfig, param_groups
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.plugins.image_classification.data import (
    MEAN_STD,
    DataConfig,
    DictDataset,
    build_source_dataset,
    check_data,
    check_not_empty,
    counted,
)
from tk.plugins.image_classification.device_pipeline import BatchAugment, decoded_split, stacked
from tk.plugins.image_classification.distill import (
    DistillConfig,
    check_distill,
    distillation_loss,
    load_teacher,
    teacher_problems,
)
from tk.plugins.image_classification.metrics import ConfusionMatrix, HeadAccuracy
from tk.plugins.image_classification.mixup import LossConfig, MixupConfig, build_mixup, check_mixup
from tk.plugins.image_classification.model import ModelConfig, both_heads, build_classifier, check_model, is_distilled
from tk.plugins.image_classification.predict import PredictConfig
from tk.plugins.image_classification.pretrained import (
    VIT_SHAPE_KEYS,
    load_pretrained_timm,
    load_pretrained_vit,
    open_vit_run,
    source_kind,
    vit_layer_id_fn,
    weights_problems,
)
from tk.plugins.image_classification.samples import SampleGrid
from tk.plugins.image_classification.streams import build_stream
from tk.plugins.image_classification.synthetic import CLASS_NAMES as SYNTHETIC_CLASSES
from tk.plugins.image_classification.transforms import (
    build_eval_transform,
    build_train_transform,
    check_auto_augment,
)

CLASSES_FILE = "classes.json"  # task file: the class names in label order
NORMALIZE_FILE = "normalize.json"  # task file: the data config (mean, std, interpolation, crop_pct) the model was trained with
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class ImageClassificationTask(Task):
    """Image classification: ViT or timm models on synthetic shapes, CIFAR-10/100 or image folders."""

    name: ClassVar[str] = "image_classification"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"mixup": MixupConfig, "loss": LossConfig, "predict": PredictConfig,
                                                         "distill": DistillConfig}
    renamed_keys: ClassVar[Mapping[str, str]] = {"model.pretrained_file": "model.pretrained_from",
                                                 "data.dataset": "data.source"}  # cifar10, cifar100 are sources

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.mixup_cfg: MixupConfig = self.sections.get("mixup") or MixupConfig()
        self.loss_cfg: LossConfig = self.sections.get("loss") or LossConfig()
        self._class_names: list[str] | None = None
        self._mixup: Any = None
        self._augment: BatchAugment | None = None  # data.pipeline=device: the batch augmentation
        self._data_config: dict[str, Any] | None = None
        self.distill_cfg: DistillConfig = self.sections.get("distill") or DistillConfig()
        self._teacher_record: dict[str, str] | None = None  # {"teacher", "sha256"} of this run's teacher
        self._saved_teacher: dict[str, str] | None = None  # the record in the checkpoint being resumed
        self.source: SourceRun | None = None  # model.pretrained_from's tk ViT run (a fresh run only)

    @classmethod
    def check_fresh_run(cls, cfg: Any) -> list[str]:
        """A tk ViT run in ``model.pretrained_from``: readable, of this task, of the recipe's shape."""
        try:
            opened = open_vit_run(cfg.sections["model"], cfg.sections["data"].img_size, cfg.given)
            if opened is not None:
                opened[0].weights()
        except TkError as e:
            return [str(e)]
        distill = cfg.sections.get("distill") or DistillConfig()
        return weights_problems(cfg.sections["model"].pretrained_from) or teacher_problems(distill, cls.name)

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        data: DataConfig = cfg.sections["data"]
        problems = check_model(cfg.sections["model"], data.img_size)
        timm_name = cfg.sections["model"].timm
        if timm_name is not None and not timm.is_model(timm_name):  # tk validate catches it, not build_model
            problems.append(f"model.timm: {timm_name!r} is not a timm model{did_you_mean(timm_name, timm.list_models())}"
                            f" (see timm.list_models())")
        problems += check_distill(cfg.sections.get("distill") or DistillConfig())
        problems += check_mixup(cfg.sections.get("mixup") or MixupConfig(), cfg.train.batch_size)
        policy_problem = check_auto_augment(data.auto_augment)
        if policy_problem:
            problems.append(f"data.auto_augment: {policy_problem}")
        problems += check_data(data)
        return problems

    # -- state -----------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Resolve the class list (fails early when the data is missing) and keep it as the
        task file ``classes.json``; a resumed, evaluated or predicting run reads it back. A fresh
        run from a tk ViT run (``model.pretrained_from``) takes its shape and normalisation."""
        record = read_record(self.files)
        opened = open_vit_run(self.model_cfg, self.data.img_size, self.cfg.given) if not resume else None
        if opened is not None:
            self.source, self.model_cfg = opened
            write_record(self.files, self.source, {k: getattr(self.model_cfg, k) for k in VIT_SHAPE_KEYS})
        elif record is not None:  # the shape it adopted from its source
            self.model_cfg = dataclasses.replace(self.model_cfg, **record["model"])
        if self._class_names is None and self.files.exists(CLASSES_FILE):
            self._class_names = json.loads(self.files.read_text(CLASSES_FILE))
        names = self.class_names
        if not resume and self.run_dir is not None and not self.files.exists(CLASSES_FILE):  # rank 0 writes first
            self.files.write_text(CLASSES_FILE, json.dumps(names, indent=1))
        if self.files.exists(NORMALIZE_FILE):
            saved = json.loads(self.files.read_text(NORMALIZE_FILE))
            # runs from before interpolation/crop_pct were saved used bilinear and the recipe's crop_pct
            self._data_config = {"interpolation": "bilinear", "crop_pct": self.data.crop_pct or 1.0, **saved}
        elif not resume and self.run_dir is not None:
            self.files.write_text(NORMALIZE_FILE, json.dumps(self.data_config))

    @property
    def data_config(self) -> dict[str, Any]:
        """The input pipeline's ``mean``, ``std``, ``interpolation`` and ``crop_pct``: the recipe's
        ``data.*`` keys where set, else timm's pretrained config when fine-tuning a timm model
        or the tk ViT's ``pretrained_from`` (timm's own ``resolve_data_config`` rule; its
        ``crop_pct`` only with ``data.crop: rrc``, the training crop it pairs with), else the data source's statistics, bilinear, 1.0.
        Saved with the run, so evaluation and prediction use what training used."""
        if self._data_config is None:
            mean, std = (list(v) for v in MEAN_STD[self.data.source])
            resolved: dict[str, Any] = {"mean": mean, "std": std, "interpolation": "bilinear", "crop_pct": 1.0}
            m = self.model_cfg
            kind = source_kind(m.pretrained_from)
            timm_name = m.timm if m.timm is not None else (m.pretrained_from if kind == "name" else None)
            if timm_name is not None and (m.pretrained or kind in ("file", "name")):
                pretrained_cfg = timm.get_pretrained_cfg(timm_name)
                if pretrained_cfg is not None:
                    resolved.update(mean=list(pretrained_cfg.mean), std=list(pretrained_cfg.std),
                                    interpolation=pretrained_cfg.interpolation or "bilinear")
                    if self.data.crop == "rrc":  # timm's crop_pct pairs with RandomResizedCrop training
                        resolved["crop_pct"] = pretrained_cfg.crop_pct or 1.0
            if self.source is not None and self.source.files_dir is not None and \
                    (self.source.files_dir / NORMALIZE_FILE).is_file():  # the input the backbone was trained on
                resolved.update(json.loads(self.source.read_file(NORMALIZE_FILE)))
            for key in resolved:
                if getattr(self.data, key) is not None:
                    resolved[key] = getattr(self.data, key)
            resolved["mean"], resolved["std"] = list(resolved["mean"]), list(resolved["std"])
            self._data_config = resolved
        return self._data_config

    @property
    def normalization(self) -> tuple[list[float], list[float]]:
        """Input (mean, std) of :attr:`data_config`."""
        return self.data_config["mean"], self.data_config["std"]

    @property
    def class_names(self) -> list[str]:
        """Class names in label order (from the checkpoint, or read from the data)."""
        if self._class_names is None:
            if self.data.source == "synthetic":
                self._class_names = list(SYNTHETIC_CLASSES)
            elif self.data.source == "cifar10":
                self._class_names = list(CIFAR10_CLASSES)
            else:  # cifar100 reads its meta file; imagefolder its train/ sub-folders
                train = (build_stream(self.data, "train", None, self.data.class_names) if self.data.streaming
                         else build_source_dataset(self.data, "train", None))
                self._class_names = list(train.classes)
        return self._class_names

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"class_names": list(self.class_names)}
        if self._teacher_record is not None:
            state["teacher"] = dict(self._teacher_record)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "class_names" in state:
            self._class_names = list(state["class_names"])
        if "teacher" in state:
            self._saved_teacher = dict(state["teacher"])
            self._teacher_record = dict(state["teacher"])

    # -- data ------------------------------------------------------------------------
    def _transform(self, training: bool):
        d, dc = self.data, self.data_config
        if not training:
            return build_eval_transform(d.img_size, dc["mean"], dc["std"], dc["crop_pct"], dc["interpolation"])
        return build_train_transform(
            d.img_size, dc["mean"], dc["std"], crop=d.crop, crop_padding=d.crop_padding, rrc_scale_min=d.rrc_scale_min,
            hflip=d.hflip, auto_augment=d.auto_augment, re_prob=d.re_prob, interpolation=dc["interpolation"],
        )

    def build_dataset(self, split: str) -> Dataset:
        """``{"image": (3, H, W) float, "labels": int}`` items of ``split``.

        CIFAR's ``"val"`` is its official test set (CIFAR has no validation split).
        """
        data = self.data
        if data.source == "webdataset" and data.class_names is None and split != "train":  # labels 0.. of train
            data = dataclasses.replace(data, class_names=self.class_names)
        if data.pipeline == "device":
            return counted(decoded_split(data, self.data_config, split, 0, self._class_names), split, self.report)
        if data.streaming:  # already yields the item dicts
            base = build_stream(data, split, self._transform(split == "train"), data.class_names)
        else:
            base = build_source_dataset(data, split, self._transform(split == "train"))
            check_not_empty(base, self.data.source, split)
        classes = getattr(base, "classes", None)
        if classes is not None and self._class_names is not None and list(classes) != self._class_names:
            raise TkError(f"the {split!r} split has classes {list(classes)[:10]}... but the model was built for "
                          f"{self._class_names[:10]}...; every split needs the same class folders")
        return base if data.streaming else counted(DictDataset(base), split, self.report)

    def build_loader(self, split: str, spec: LoaderSpec) -> DataLoader:
        """The core loader; with ``data.pipeline=device`` over the decoded split, a batch gathered at
        once in this process (its loader workers, if any, decode the split once)."""
        if self.data.pipeline != "device":
            return super().build_loader(split, spec)
        decoded = decoded_split(self.data, self.data_config, split, spec.num_workers, self._class_names)
        return build_loader(decoded, dataclasses.replace(spec, num_workers=0), collate_fn=stacked)

    def transform_batch(self, batch: dict[str, Any], training: bool) -> dict[str, Any]:
        """Mixup/CutMix in training (labels become (B, C) soft targets); identity otherwise. With
        ``data.pipeline=device`` the uint8 images are first normalised (and augmented in training)
        here, on the batch's device."""
        if self.data.pipeline == "device":
            if self._augment is None:
                d = self.data
                self._augment = BatchAugment(*self.normalization, crop_padding=d.crop_padding if d.crop == "pad" else 0,
                                             hflip=d.hflip, re_prob=d.re_prob, auto_augment=d.auto_augment)
            batch = {**batch, "image": self._augment(batch["image"], training)}
        if not training or not self.mixup_cfg.enabled:
            return batch
        if self._mixup is None:
            self._mixup = build_mixup(self.mixup_cfg, self.num_classes, self.loss_cfg.label_smoothing)
        images, labels = batch["image"], batch["labels"]
        if images.shape[0] % 2:
            raise TkError(f"Mixup/CutMix needs an even batch, got {images.shape[0]}; set an even "
                          f"train.batch_size (and keep drop_last for training)")
        images, targets = self._mixup(images.clone(), labels)  # timm mixes in place
        return {**batch, "image": images, "labels": targets}

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_classifier(self.model_cfg, self.num_classes, self.data.img_size)

    def example_inputs(self, model: nn.Module) -> dict[str, Any]:
        """``tk export``: two random images of the run's input size."""
        return {"x": torch.randn(2, 3, self.data.img_size, self.data.img_size)}

    def init_pretrained(self, model: nn.Module) -> None:
        """``model.pretrained`` / ``model.pretrained_from``: a tk ViT run's or timm's weights into a
        fresh run's model (heads stay new); eval and predict of the finished run load its own weights."""
        m = self.model_cfg
        if self.source is not None:
            load_pretrained_vit(model, self.source.spec, weights=self.source.weights())
            self.source = None  # done: drop the mapped checkpoint
            return
        kind = source_kind(m.pretrained_from)
        if not (m.pretrained or kind) or kind == "run":  # a run: loaded above (opened in setup)
            return
        file = m.pretrained_from if kind == "file" else None
        if m.timm is not None:
            load_pretrained_timm(model, m.timm, self.num_classes, self.data.img_size, file)
        else:
            load_pretrained_vit(model, file, m.pretrained_from if kind == "name" else None)

    def param_groups(self, model: nn.Module, optim_cfg: OptimConfig) -> list[dict[str, Any]]:
        """Core's groups; ``optim.layer_decay`` on a timm ViT uses its block index as layer id."""
        ids = vit_layer_id_fn(model) if optim_cfg.layer_decay is not None and not hasattr(model, "layer_id") else None
        if ids is None:
            return param_groups(model, optim_cfg)
        return param_groups(model, optim_cfg, layer_id_fn=ids[0], num_layers=ids[1])

    def build_teacher(self) -> nn.Module | None:
        """The frozen teacher of ``distill.teacher`` (None without distillation).

        Raises:
            TkError: a teacher with other class names, or (resuming) another teacher than
                the one the checkpoint recorded, naming both.
        """
        if self.distill_cfg.type == "none":
            return None
        teacher, record = load_teacher(self.distill_cfg, self.class_names)
        check_same_teacher(self._saved_teacher, record)
        self._teacher_record = record
        return teacher

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Cross-entropy summed over the batch, on Mixup/CutMix's soft targets when mixing;
        label smoothing in training only (evaluation reports plain cross-entropy).

        With ``distill.type`` soft/hard in training, DeiT's loss against the teacher's
        logits on the same (augmented, mixed) images (:mod:`.distill`). A distilled model
        (DeiT token) returns both heads in training; its eval output is their mean.
        """
        images = batch["image"]
        out = model(images)  # (B, C), or the DeiT pair (cls, dist) in training
        labels = batch["labels"]  # (B,) class indices, or (B, C) mixed targets, smoothed already
        smoothing = self.loss_cfg.label_smoothing if model.training and not labels.is_floating_point() else 0.0
        if model.training and self.distill_cfg.type != "none" and self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(images)  # under the run's autocast, like the student
            loss, count, logs = distillation_loss(self.distill_cfg, out, labels, teacher_logits, smoothing)
            logits = out[0] if isinstance(out, tuple) else out
            return StepOutput(loss=loss, num_items=count, logs=logs, outputs=logits.detach())
        if isinstance(out, tuple):  # DeiT training without a teacher: both heads learn the labels
            loss, count = cross_entropy_sum(out[0], labels, label_smoothing=smoothing)
            loss_dist, _ = cross_entropy_sum(out[1], labels, label_smoothing=smoothing)
            return StepOutput(loss=(loss + loss_dist) / 2, num_items=count, outputs=out[0].detach())
        loss, count = cross_entropy_sum(out, labels, label_smoothing=smoothing)
        return StepOutput(loss=loss, num_items=count, outputs=out.detach())

    def eval_step(self, model: nn.Module, batch: dict[str, Any], ctx: EvalContext) -> StepOutput:
        """Plain cross-entropy of the model's eval output; a distilled model's outputs also
        carry each head (``val/top1_cls``, ``val/top1_dist``); ``logits`` is their mean."""
        if not is_distilled(model):
            return self.loss(model, batch)
        cls_logits, dist_logits = both_heads(model, batch["image"])
        logits = (cls_logits + dist_logits) / 2
        loss, count = cross_entropy_sum(logits, batch["labels"])
        return StepOutput(loss=loss, num_items=count,
                          outputs={"logits": logits.detach(), "cls": cls_logits.detach(), "dist": dist_logits.detach()})

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        topk = (1, 5) if self.num_classes >= 5 else (1,)
        metrics: dict[str, Metric] = {"accuracy": Accuracy(topk=topk), "per_class": ConfusionMatrix(self.class_names)}
        if self.model_cfg.distilled or "distilled" in (self.model_cfg.timm or ""):
            metrics.update(head_cls=HeadAccuracy("cls"), head_dist=HeadAccuracy("dist"))
        if ctx is not None and ctx.kind != "standalone" and ctx.key_prefix == "val":  # the grid, during training
            metrics["samples"] = SampleGrid(self.class_names, *self.normalization)
        return metrics

    # -- inference ---------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """Top-k classes of image files; k is ``predict.top_k``.

        Args:
            model: the trained classifier (on its device).
            inputs: image file paths.

        Returns:
            One dict per input, in order: ``{"input": path, "top_k": [{"label": name, "prob": p}, ...]}``,
            most likely first; ``{"input": path, "error": "cannot read image PATH: ..."}`` for a file
            that cannot be read as an image (the model runs on the others).
        """
        from PIL import Image

        top_k = (self.sections.get("predict") or PredictConfig()).top_k
        transform = self._transform(training=False)
        results: list[dict[str, Any]] = []
        images = []
        for path in inputs:
            try:
                with Image.open(path) as img:
                    images.append(transform(img.convert("RGB")))
                results.append({"input": path})
            except (OSError, ValueError) as e:
                results.append({"input": path, "error": f"cannot read image {path}: {e}"})
        if not images:
            return results
        device = next(model.parameters()).device
        model.eval()
        probs = model(torch.stack(images).to(device)).float().softmax(-1)  # (B, C)
        values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        good = iter(zip(indices.tolist(), values.tolist()))
        for result in results:
            if "error" not in result:
                idx, val = next(good)
                result["top_k"] = [{"label": self.class_names[i], "prob": p} for i, p in zip(idx, val)]
        return results
