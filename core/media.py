"""Media a task logs at evaluations: images and text, sent to every logger of the run.

A metric (``tk.core.metrics.Metric``) that wants to show samples defines
``media(self, ctx) -> list[Image | Text]``; the engine calls it on rank 0 after each
evaluation during training (not in ``tk eval``) and hands the items to the run's loggers:
``media/<tag>_step_<N>.png`` / ``.txt`` in the run dir, TensorBoard images and text,
W&B images and HTML. Tags look like scalar names: ``f"{ctx.key_prefix}/samples"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image as PILImage

from tk.core.errors import TkError

__all__ = ["Image", "Text", "Media", "media_file", "write_media_file"]


@dataclass
class Image:
    """One image to log.

    Attributes:
        tag: its name, e.g. ``"val/samples"``.
        pixels: (H, W, 3) or (H, W) ``uint8`` array.
        caption: a line shown with it in W&B.
    """

    tag: str
    pixels: np.ndarray
    caption: str = ""

    def __post_init__(self) -> None:
        a = np.asarray(self.pixels)
        if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] != 3):
            raise TkError(f"media image {self.tag!r}: expected an (H, W, 3) or (H, W) uint8 array, got "
                          f"{a.dtype} {tuple(a.shape)}")
        self.pixels = a


@dataclass
class Text:
    """A piece of text to log (decoded translations, generations).

    Attributes:
        tag: its name, e.g. ``"val/translations"``.
        text: plain text; newlines are kept.
    """

    tag: str
    text: str


Media = Image | Text


def media_file(run_dir: Path, item: Media, step: int) -> Path:
    """Where ``item`` of ``step`` goes in the run dir: ``media/val_samples_step_00000200.png``."""
    stem = item.tag.replace("/", "_").replace(" ", "_")
    return run_dir / "media" / f"{stem}_step_{step:08d}.{'png' if isinstance(item, Image) else 'txt'}"


def write_media_file(run_dir: Path, item: Media, step: int) -> Path:
    """Write ``item`` as a PNG or ``.txt`` under ``run_dir/media``; returns the path."""
    path = media_file(run_dir, item, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(item, Image):
        PILImage.fromarray(item.pixels).save(path)
    else:
        path.write_text(item.text, encoding="utf-8")
    return path
