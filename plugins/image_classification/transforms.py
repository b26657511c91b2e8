"""Train/eval image transforms, assembled from torchvision and timm parts.

RandAugment / AutoAugment: Cubuk et al. 2019/2020, https://arxiv.org/abs/1909.13719;
random erasing: Zhong et al. 2020, https://arxiv.org/abs/1708.04896.
"""

from __future__ import annotations

import re
from typing import Sequence

from timm.data.auto_augment import auto_augment_transform, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import str_to_pil_interp
from torchvision import transforms as T

_AUTO_AUGMENT_POLICIES = ("original", "originalr", "v0r")


def check_auto_augment(policy: str | None) -> str | None:
    """Why ``policy`` cannot be used, or None if it can.

    Accepts timm's RandAugment strings (``rand-m9-mstd0.5``) and AutoAugment policy
    names (``original``, ``originalr``, ``v0r``, optionally with ``-mstd..``). Rejects
    policies whose Posterize op can be asked to keep 0 bits, which Pillow >= 13
    refuses mid-training ("bits must be between or equal to 1 and 8"): the
    ``inc1`` variants at high magnitude, low RandAugment magnitudes and ``v0``.
    """
    if not policy:
        return None
    parts = policy.split("-")
    if parts[0] == "rand":
        opts = dict(re.match(r"([a-z]+)(.*)", p).groups() for p in parts[1:] if re.match(r"[a-z]+", p))
        if opts.get("inc", "0") not in ("", "0"):
            return (f"{policy!r}: RandAugment 'inc1' policies crash in Posterize under Pillow >= 13; "
                    f"drop '-inc1', e.g. 'rand-m9-mstd0.5'")
        try:
            magnitude, std = float(opts.get("m", 10)), float(opts.get("mstd", 0))
        except ValueError:
            return f"{policy!r} is not a valid RandAugment string; e.g. 'rand-m9-mstd0.5' (see timm docs)"
        # Posterize keeps int(m * 0.4) bits: 0 bits for m < 2.5, so keep m well above that
        if std > 100 or magnitude - 6 * std < 2.5:
            return (f"{policy!r}: magnitude m={magnitude:g} with mstd={std:g} can reach m < 2.5, where "
                    f"Posterize keeps 0 bits and Pillow fails; use m >= 3 and m - 6*mstd >= 2.5")
        return None
    if parts[0] in _AUTO_AUGMENT_POLICIES:
        return None
    return (f"auto_augment {policy!r} is not supported; use a RandAugment string such as "
            f"'rand-m9-mstd0.5' or an AutoAugment policy from {list(_AUTO_AUGMENT_POLICIES)}")


def build_train_transform(
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    crop: str = "pad",
    crop_padding: int = 4,
    rrc_scale_min: float = 0.08,
    hflip: float = 0.5,
    auto_augment: str | None = None,
    re_prob: float = 0.0,
    interpolation: str = "bilinear",
):
    """PIL image -> normalised (3, H, W) float tensor with random augmentation.

    Args:
        img_size: output side H = W in pixels.
        mean, std: per-channel normalisation constants (0-1 scale).
        crop: ``"pad"`` (resize, pad by ``crop_padding``, random crop: the CIFAR recipe),
            ``"rrc"`` (RandomResizedCrop with area scale in [rrc_scale_min, 1]) or ``"none"``.
        hflip: probability of a horizontal flip.
        auto_augment: RandAugment/AutoAugment policy string (see ``check_auto_augment``).
        re_prob: probability of random erasing (per image, random-pixel fill).
        interpolation: resize filter (``bilinear``, ``bicubic`` or ``nearest``).

    Raises:
        ValueError: for an unknown ``crop`` or an unusable ``auto_augment`` policy.
    """
    mode = T.InterpolationMode(interpolation)
    if crop == "pad":
        ops = [T.Resize(img_size, interpolation=mode), T.RandomCrop(img_size, padding=crop_padding, pad_if_needed=True)]
    elif crop == "rrc":
        ops = [T.RandomResizedCrop(img_size, scale=(rrc_scale_min, 1.0), interpolation=mode)]
    elif crop == "none":
        ops = [T.Resize(img_size, interpolation=mode), T.CenterCrop(img_size)]
    else:
        raise ValueError(f"crop {crop!r} must be one of 'pad', 'rrc', 'none'")
    if hflip > 0:
        ops.append(T.RandomHorizontalFlip(hflip))
    if auto_augment:
        problem = check_auto_augment(auto_augment)
        if problem:
            raise ValueError(problem)
        hparams = {"translate_const": int(img_size * 0.45), "img_mean": tuple(round(255 * m) for m in mean),
                   "interpolation": str_to_pil_interp(interpolation)}
        factory = rand_augment_transform if auto_augment.startswith("rand") else auto_augment_transform
        ops.append(factory(auto_augment, hparams))
    ops += [T.ToTensor(), T.Normalize(mean, std)]
    if re_prob > 0:
        ops.append(RandomErasing(re_prob, mode="pixel", device="cpu"))
    return T.Compose(ops)


def build_eval_transform(img_size: int, mean: Sequence[float], std: Sequence[float], crop_pct: float = 1.0,
                         interpolation: str = "bilinear"):
    """PIL image -> normalised (3, H, W) tensor: resize the short side to
    ``img_size / crop_pct`` with ``interpolation``, then centre-crop ``img_size``."""
    return T.Compose([
        T.Resize(int(round(img_size / crop_pct)), interpolation=T.InterpolationMode(interpolation)),
        T.CenterCrop(img_size),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])
