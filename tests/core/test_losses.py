"""tk.core.losses against hand computations, torch's F.cross_entropy and timm's SoftTargetCrossEntropy."""

import math

import pytest
import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from tk.core.losses import cross_entropy_sum, kl_distillation_loss


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(z - top) for z in row))
    return [z - lse for z in row]


def test_label_smoothed_sum_equals_a_hand_computation_and_torch():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
    targets = torch.tensor([0, 1])
    eps, num_classes = 0.1, 3
    by_hand = 0.0
    for row, label in zip(logits.tolist(), targets.tolist()):
        logp = _log_softmax(row)
        by_hand -= sum((eps / num_classes + (1 - eps) * (c == label)) * logp[c] for c in range(num_classes))
    loss, count = cross_entropy_sum(logits, targets, label_smoothing=eps)
    assert count == 2 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets, reduction="sum", label_smoothing=eps))


def test_token_logits_with_ignore_index_skip_and_do_not_count_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)  # (B, T, C)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 3:] = -100
    targets[1, 4] = -100
    loss, count = cross_entropy_sum(logits, targets, label_smoothing=0.2, ignore_index=-100)
    assert torch.is_tensor(count) and count.item() == 7
    want = F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum", label_smoothing=0.2, ignore_index=-100)
    torch.testing.assert_close(loss, want)
    kept = targets != -100
    torch.testing.assert_close(loss, cross_entropy_sum(logits[kept], targets[kept], label_smoothing=0.2)[0])


def test_soft_targets_equal_timm_soft_target_cross_entropy_times_batch_size():
    torch.manual_seed(0)
    logits = torch.randn(6, 10)
    targets = torch.softmax(torch.randn(6, 10), dim=-1)
    loss, count = cross_entropy_sum(logits, targets)
    assert count == 6
    torch.testing.assert_close(loss, SoftTargetCrossEntropy()(logits, targets) * 6)


def test_log_softmax_runs_in_fp32_for_low_precision_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, 5).bfloat16()
    targets = torch.tensor([0, 1, 2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = cross_entropy_sum(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), targets, reduction="sum"))


def test_shape_and_option_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"class-index targets must have shape \(2,\)"):
        cross_entropy_sum(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="ignore_index applies to class-index targets only"):
        cross_entropy_sum(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), ignore_index=-100)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_kl_distillation_equals_a_hand_computation(tau):
    student = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    by_hand = 0.0
    for s, t in zip(student.tolist(), teacher.tolist()):
        log_ps, log_pt = _log_softmax([z / tau for z in s]), _log_softmax([z / tau for z in t])
        by_hand += tau ** 2 * sum(math.exp(lt) * (lt - ls) for lt, ls in zip(log_pt, log_ps))
    loss, count = kl_distillation_loss(student, teacher, temperature=tau)
    assert count == 2
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    loss.backward()  # the gradient reaches the student only
    assert student.grad is not None and torch.isfinite(student.grad).all()


def test_kl_distillation_ignore_mask_leaves_items_out():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    mask = torch.tensor([[False, False, True, True], [False, False, False, True]])
    loss, count = kl_distillation_loss(student, teacher, 2.0, ignore_mask=mask)
    assert count.item() == 5
    want, _ = kl_distillation_loss(student[~mask], teacher[~mask], 2.0)
    torch.testing.assert_close(loss, want)
    assert kl_distillation_loss(teacher, teacher)[0].item() == pytest.approx(0.0, abs=1e-6)
