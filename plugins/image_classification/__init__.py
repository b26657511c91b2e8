"""Image classification plugin: ViT/timm models, CIFAR/image folders/synthetic shapes, Mixup/CutMix."""

from tk.plugins.image_classification.task import ImageClassificationTask

__all__ = ["ImageClassificationTask"]
