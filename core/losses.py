"""Losses summed over items, ready for ``StepOutput(loss=..., num_items=...)``.

Each returns ``(loss_sum, num_items)``: the engine divides the accumulated sum by the
accumulated count once per update, so gradient accumulation stays exact.

Label smoothing: Szegedy et al. 2016, https://arxiv.org/abs/1512.00567.
Knowledge distillation: Hinton et al. 2015, https://arxiv.org/abs/1503.02531;
DeiT's soft distillation: Touvron et al. 2021, https://arxiv.org/abs/2012.12877.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy_sum", "kl_distillation_loss"]


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0,
                      ignore_index: int | None = None) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Cross-entropy summed over items, for class-index or soft (mixed) targets.

    The log-softmax runs in fp32 whatever the logits' dtype (bf16/fp16 under autocast).
    With label smoothing ``eps`` the target of an item is ``1 - eps + eps / C`` on its
    class and ``eps / C`` elsewhere (``F.cross_entropy``'s convention); soft targets are
    smoothed the same way (``p * (1 - eps) + eps / C``), so pass ``label_smoothing=0``
    for targets that already include it (timm's Mixup with ``label_smoothing``).

    Args:
        logits: (B, C) or (B, T, C) scores (any leading shape, classes last).
        targets: class indices of the leading shape, (B,) or (B, T), integer; or soft
            targets of the logits' shape, (B, C) or (B, T, C), float rows summing to 1.
        label_smoothing: epsilon in [0, 1).
        ignore_index: class-index targets equal to it contribute nothing and are not
            counted (e.g. -100 for padding tokens); None: every item counts.

    Returns:
        ``(loss_sum, num_items)``: a 0-dim fp32 tensor, and the number of items it sums
        over: an int, or a 0-dim long tensor when ``ignore_index`` is given (counted on
        the device, no host sync).

    Raises:
        ValueError: targets whose shape fits neither form, or ``ignore_index`` with
            soft targets.
    """
    num_classes = logits.shape[-1]
    flat = logits.float().reshape(-1, num_classes)  # (N, C)
    if targets.is_floating_point():
        if targets.shape != logits.shape:
            raise ValueError(f"soft targets must have the logits' shape {tuple(logits.shape)}, got {tuple(targets.shape)}")
        if ignore_index is not None:
            raise ValueError("ignore_index applies to class-index targets only; mask soft targets before the loss")
        loss = F.cross_entropy(flat, targets.float().reshape(-1, num_classes), reduction="sum",
                               label_smoothing=label_smoothing)
        return loss, flat.shape[0]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"class-index targets must have shape {tuple(logits.shape[:-1])} (the logits' without "
                         f"classes), got {tuple(targets.shape)}")
    targets = targets.reshape(-1)  # (N,)
    if ignore_index is None:
        return F.cross_entropy(flat, targets, reduction="sum", label_smoothing=label_smoothing), targets.numel()
    loss = F.cross_entropy(flat, targets, reduction="sum", label_smoothing=label_smoothing, ignore_index=ignore_index)
    return loss, targets.ne(ignore_index).sum()


def kl_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, *,
                         ignore_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Soft distillation: ``tau**2 * KL(softmax(teacher / tau) || softmax(student / tau))``
    summed over items (Hinton et al.; DeiT's ``soft`` distillation).

    The ``tau**2`` keeps the gradient's size independent of the temperature. The
    teacher gets no gradient; softmaxes run in fp32.

    Args:
        student_logits: (B, C) or (B, T, C) scores of the model being trained.
        teacher_logits: scores of the teacher, same shape.
        temperature: tau > 0; higher values soften both distributions.
        ignore_mask: bool of the leading shape, (B,) or (B, T); True leaves an item out
            (padding), the tk mask convention. None: every item counts.

    Returns:
        ``(loss_sum, num_items)``: a 0-dim fp32 tensor, and the item count (an int, or a
        0-dim long tensor with ``ignore_mask``).

    Raises:
        ValueError: mismatching shapes or a temperature <= 0.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    per_item = F.kl_div(log_p_student, log_p_teacher, reduction="none", log_target=True).sum(-1)  # (B,) / (B, T)
    scale = temperature * temperature
    if ignore_mask is None:
        return per_item.sum() * scale, per_item.numel()
    if ignore_mask.shape != per_item.shape:
        raise ValueError(f"ignore_mask must have shape {tuple(per_item.shape)}, got {tuple(ignore_mask.shape)}")
    return per_item.masked_fill(ignore_mask, 0.0).sum() * scale, (~ignore_mask).sum()
