"""A grid of validation images with their predicted and true labels, logged as media
at each evaluation during training (TensorBoard, W&B, ``media/val_samples_step_N.png``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image as PILImage
from PIL import ImageDraw, ImageFont

from tk.core.media import Image
from tk.core.metrics import Metric
from tk.core.step import EvalContext

TILE = 96  # pixels per image side in the grid (small images are enlarged, nearest neighbour)
CAPTION = 26  # pixels of caption under each image: two lines, predicted and true
RIGHT, WRONG = (0, 120, 0), (200, 0, 0)


class SampleGrid(Metric):
    """Keeps the first ``count`` images of the evaluation (this process's shard) and their
    predictions; ``media`` draws them as one grid, captions in green when right, red when
    wrong. No scalar results.

    Args:
        class_names: the C class names, in label order.
        mean, std: the input normalisation (per channel), undone for display.
        count: images in the grid.
    """

    def __init__(self, class_names: Sequence[str], mean: Sequence[float], std: Sequence[float],
                 count: int = 16) -> None:
        super().__init__()
        self.class_names, self.count = list(class_names), count
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.images: list[torch.Tensor] = []  # (3, H, W) in [0, 1]
        self.labels: list[tuple[int, int]] = []  # (predicted, true)

    def keys(self) -> list[str]:
        return []

    def compute(self) -> dict[str, float]:
        return {}

    def update(self, out: Any, batch: Mapping[str, Any]) -> None:
        take = self.count - len(self.images)
        if take <= 0:
            return
        logits = out.outputs["logits"] if isinstance(out.outputs, Mapping) else out.outputs
        target = batch["labels"][:take]
        if target.ndim == 2:  # soft targets: the dominant class
            target = target.argmax(-1)
        images = batch["image"][:take].detach().float().cpu()  # (b, C, H, W), normalised
        images = (images * self.std + self.mean).clamp(0, 1)
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        self.images += list(images)
        self.labels += list(zip(logits[:take].argmax(-1).tolist(), target.tolist()))

    def media(self, ctx: EvalContext) -> list[Image]:
        """One image: the grid, tagged ``<prefix>/samples``."""
        if not self.images:
            return []
        right = sum(p == t for p, t in self.labels)
        return [Image(f"{ctx.key_prefix}/samples", self.grid(),
                      caption=f"step {ctx.step}: {right}/{len(self.labels)} right (p: predicted, t: true)")]

    def grid(self) -> np.ndarray:
        """The (rows * (TILE + CAPTION), cols * TILE, 3) uint8 grid."""
        cols = min(len(self.images), 8)
        rows = math.ceil(len(self.images) / cols)
        canvas = PILImage.new("RGB", (cols * TILE, rows * (TILE + CAPTION)), "white")
        draw = ImageDraw.Draw(canvas)
        font = ImageFont.load_default()
        chars = TILE // 6  # the default font is about 6 px wide
        for i, (image, (pred, true)) in enumerate(zip(self.images, self.labels)):
            x, y = i % cols * TILE, i // cols * (TILE + CAPTION)
            pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            tile = PILImage.fromarray(pixels)
            if max(tile.size) > TILE:
                tile.thumbnail((TILE, TILE))
            scale = max(1, TILE // max(tile.size))
            tile = tile.resize((tile.width * scale, tile.height * scale), PILImage.NEAREST)
            canvas.paste(tile, (x + (TILE - tile.width) // 2, y + (TILE - tile.height) // 2))
            color = RIGHT if pred == true else WRONG
            draw.text((x + 2, y + TILE), f"p: {self._name(pred)}"[:chars], fill=color, font=font)
            draw.text((x + 2, y + TILE + CAPTION // 2), f"t: {self._name(true)}"[:chars], fill=(0, 0, 0), font=font)
        return np.asarray(canvas)

    def _name(self, index: int) -> str:
        return self.class_names[index] if 0 <= index < len(self.class_names) else str(index)
