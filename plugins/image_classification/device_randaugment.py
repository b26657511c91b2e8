"""RandAugment on a batch where the batch is (``data.pipeline: device`` with ``data.auto_augment``).

timm's ``rand_augment_transform`` ("rand-m9-mstd0.5": Cubuk et al. 2020, https://arxiv.org/abs/1909.13719)
draws, per image and layer, one of 15 ops uniformly, applies it with probability ``p`` at a
magnitude from N(m, mstd) clipped to [0, 10], with a random sign for the geometric ops, and runs
it in PIL. Here every draw is made per sample for the whole batch at once and each op is applied,
vectorised, to the samples that drew it: colour ops as the blends PIL's ``ImageEnhance`` computes,
geometric ops as PIL's affine maps (the same matrices, bilinear sampling, the recipe's mean colour
as fill), histogram ops through torchvision's batched ``autocontrast``/``equalize`` (which follow
PIL's). Images stay whole numbers in [0, 255] after every op, as PIL's uint8 images do.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

RAND_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
            "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")  # timm's order
LEVEL_DENOM = 10.0  # timm: magnitudes are out of 10
TRANSLATE_PCT = 0.45  # timm: TranslateXRel/YRel shift up to 45% of the side
GRAY = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, PIL's "L" conversion


@dataclass
class RandAugmentSpec:
    """The parts of a timm RandAugment string that the batch version uses."""

    magnitude: float = 10.0  # m
    num_layers: int = 2  # n: ops per image
    prob: float = 0.5  # p: probability of applying each drawn op
    magnitude_std: float = 0.0  # mstd: per-draw Gaussian noise on m (inf: uniform in [0, m])
    magnitude_max: float = LEVEL_DENOM  # mmax: upper clip of the drawn magnitude


def parse_rand_augment(policy: str) -> RandAugmentSpec:
    """``"rand-m9-mstd0.5"`` (keys m, n, p, mstd, mmax) as a :class:`RandAugmentSpec`.

    Raises:
        ValueError: not a RandAugment string, or a key the batch version does not implement
            (``inc``, ``w``, ``t``: the PIL path has them).
    """
    parts = policy.split("-")
    if parts[0] != "rand":
        raise ValueError(f"{policy!r}: data.pipeline=device runs RandAugment strings ('rand-m9-mstd0.5'); "
                         f"AutoAugment policies run on PIL in the loader workers (data.pipeline=workers)")
    spec = RandAugmentSpec()
    fields = {"m": "magnitude", "n": "num_layers", "p": "prob", "mstd": "magnitude_std", "mmax": "magnitude_max"}
    for part in parts[1:]:
        match = re.fullmatch(r"([a-z]+)([0-9.]+|inf)", part)
        if match is None or match.group(1) not in fields:
            raise ValueError(f"{policy!r}: {part!r} is not one of the RandAugment keys data.pipeline=device "
                             f"implements ({', '.join(fields)}); use data.pipeline=workers for the others")
        name, value = fields[match.group(1)], float(match.group(2))
        setattr(spec, name, int(value) if name == "num_layers" else value)
    return spec


# -- the ops: x is (N, C, H, W) float holding whole numbers in [0, 255]; level is (N,) ------------
def _blend(image: Tensor, other: Tensor, factor: Tensor) -> Tensor:
    """PIL ``ImageEnhance``: ``other + factor * (image - other)``, clipped to [0, 255]."""
    return (other + factor.view(-1, 1, 1, 1) * (image - other)).round().clamp(0, 255)


def _gray(x: Tensor) -> Tensor:
    weights = torch.tensor(GRAY, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * weights).sum(1, keepdim=True).round()


def _enhance_factor(level: Tensor) -> Tensor:
    return level / LEVEL_DENOM * 1.8 + 0.1  # timm's _enhance_level_to_arg: [0.1, 1.9]


def color(x: Tensor, level: Tensor) -> Tensor:
    return _blend(x, _gray(x), _enhance_factor(level))


def contrast(x: Tensor, level: Tensor) -> Tensor:
    mean = (_gray(x).mean(dim=(1, 2, 3), keepdim=True) + 0.5).floor()  # PIL: int(mean of L + 0.5)
    return _blend(x, mean.expand_as(x), _enhance_factor(level))


def brightness(x: Tensor, level: Tensor) -> Tensor:
    return _blend(x, torch.zeros_like(x), _enhance_factor(level))


def sharpness(x: Tensor, level: Tensor) -> Tensor:
    """PIL's SMOOTH filter ([[1,1,1],[1,5,1],[1,1,1]] / 13) inside, the border kept, then the blend."""
    kernel = torch.ones(3, 3, dtype=x.dtype, device=x.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / kernel.sum()).expand(x.shape[1], 1, 3, 3)
    smooth = x.clone()
    smooth[..., 1:-1, 1:-1] = F.conv2d(x, kernel, groups=x.shape[1]).round()
    return _blend(x, smooth, _enhance_factor(level))


def posterize(x: Tensor, level: Tensor) -> Tensor:
    bits = (level / LEVEL_DENOM * 4).floor()  # bits kept, timm's _posterize_level_to_arg
    step = torch.pow(2.0, 8 - bits).view(-1, 1, 1, 1)
    return torch.where(bits.view(-1, 1, 1, 1) >= 8, x, (x / step).floor() * step)


def solarize(x: Tensor, level: Tensor) -> Tensor:
    threshold = (level / LEVEL_DENOM * 256).floor().clamp(max=256).view(-1, 1, 1, 1)
    return torch.where(x >= threshold, 255 - x, x)


def solarize_add(x: Tensor, level: Tensor) -> Tensor:
    add = (level / LEVEL_DENOM * 110).floor().clamp(max=128).view(-1, 1, 1, 1)
    return torch.where(x < 128, (x + add).clamp(max=255), x)


def invert(x: Tensor, level: Tensor) -> Tensor:
    return 255 - x


def auto_contrast(x: Tensor, level: Tensor) -> Tensor:
    return TF.autocontrast(x.to(torch.uint8)).to(x.dtype)


def equalize(x: Tensor, level: Tensor) -> Tensor:
    return TF.equalize(x.to(torch.uint8)).to(x.dtype)


def _affine(x: Tensor, matrix: Tensor, fill: Tensor) -> Tensor:
    """PIL ``Image.transform(AFFINE, (a, b, c, d, e, f))`` per sample: output pixel centre (X, Y)
    samples the input at (aX + bY + c, dX + eY + f), bilinear, ``fill`` outside."""
    n, _, height, width = x.shape
    a, b, c, d, e, f = matrix.unbind(1)
    theta = torch.stack([
        torch.stack([a, b * height / width, a + b * height / width + 2 * c / width - 1], 1),
        torch.stack([d * width / height, e, d * width / height + e + 2 * f / height - 1], 1),
    ], 1)  # the same map in grid_sample's [-1, 1] coordinates (align_corners=False)
    grid = F.affine_grid(theta, [n, 1, height, width], align_corners=False)
    inside = torch.ones_like(x[:, :1])
    sampled = F.grid_sample(torch.cat([x, inside], 1), grid, mode="bilinear", padding_mode="zeros",
                            align_corners=False)
    image, weight = sampled[:, :-1], sampled[:, -1:]
    return (image + (1 - weight) * fill.view(1, -1, 1, 1)).round().clamp(0, 255)


def _signed(value: Tensor) -> Tensor:
    """timm's _randomly_negate: each value negated with probability 1/2."""
    return torch.where(torch.rand_like(value) < 0.5, -value, value)


def _geometric(kind: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    def op(x: Tensor, level: Tensor, fill: Tensor) -> Tensor:
        n, _, height, width = x.shape
        one, zero = torch.ones_like(level), torch.zeros_like(level)
        if kind == "Rotate":  # PIL rotate: counter-clockwise about the centre
            angle = -torch.deg2rad(_signed(level / LEVEL_DENOM * 30))
            cos, sin = torch.cos(angle), torch.sin(angle)
            cx, cy = width / 2, height / 2
            matrix = [cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy]
        elif kind in ("ShearX", "ShearY"):
            shear = _signed(level / LEVEL_DENOM * 0.3)
            matrix = [one, shear, zero, zero, one, zero] if kind == "ShearX" else [one, zero, zero, shear, one, zero]
        else:
            shift = _signed(level / LEVEL_DENOM * TRANSLATE_PCT)
            matrix = [one, zero, shift * width, zero, one, zero] if kind == "TranslateXRel" else \
                [one, zero, zero, zero, one, shift * height]
        return _affine(x, torch.stack(matrix, 1), fill)
    return op


COLOR_OPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "AutoContrast": auto_contrast, "Equalize": equalize, "Invert": invert, "Posterize": posterize,
    "Solarize": solarize, "SolarizeAdd": solarize_add, "Color": color, "Contrast": contrast,
    "Brightness": brightness, "Sharpness": sharpness,
}
GEOMETRIC_OPS = {name: _geometric(name) for name in ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")}


class BatchRandAugment:
    """timm's RandAugment drawn per sample, applied per op to the samples that drew it.

    Args:
        spec: the policy (:func:`parse_rand_augment`).
        fill: the fill colour of the geometric ops (0-255 per channel; timm: the mean colour).
    """

    def __init__(self, spec: RandAugmentSpec, fill: Sequence[float]) -> None:
        self.spec = spec
        self.fill = list(fill)

    def draw(self, n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(op index (L, n), applied (L, n), magnitude (L, n)) for ``n`` images and L layers."""
        s = self.spec
        shape = (s.num_layers, n)
        ops = torch.randint(0, len(RAND_OPS), shape, device=device)
        applied = torch.rand(shape, device=device) < s.prob
        magnitude = torch.full(shape, float(s.magnitude), device=device)
        if math.isinf(s.magnitude_std):
            magnitude = torch.rand(shape, device=device) * s.magnitude
        elif s.magnitude_std > 0:
            magnitude = magnitude + s.magnitude_std * torch.randn(shape, device=device)
        return ops, applied, magnitude.clamp(0.0, s.magnitude_max)

    def __call__(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> uint8, each image through its own drawn ops."""
        x = images.to(torch.float32)
        fill = torch.tensor(self.fill, dtype=x.dtype, device=x.device)
        ops, applied, magnitude = self.draw(x.shape[0], x.device)
        skip = len(RAND_OPS)  # the bucket of images whose op was not applied
        for layer in range(self.spec.num_layers):
            # images sorted by their op: each op runs once on a slice; one host sync per layer (the counts)
            key = torch.where(applied[layer], ops[layer], skip)
            order = torch.argsort(key, stable=True)
            counts = torch.bincount(key, minlength=skip + 1).tolist()
            ordered, levels = x.index_select(0, order), magnitude[layer].index_select(0, order)
            pieces, start = [], 0
            for index, count in enumerate(counts):
                piece, level = ordered[start:start + count], levels[start:start + count]
                if count and index < skip:
                    name = RAND_OPS[index]
                    piece = GEOMETRIC_OPS[name](piece, level, fill) if name in GEOMETRIC_OPS else \
                        COLOR_OPS[name](piece, level)
                pieces.append(piece)
                start += count
            x = torch.empty_like(x).index_copy_(0, order, torch.cat(pieces))
        return x.to(torch.uint8)
