"""Tests for tk.core.training.precision: autocast choice, device errors, and loss-scaling skip logic
(run on CPU through torch.amp.GradScaler("cpu"))."""

import copy

import pytest
import torch
from torch import nn

from tk.core.errors import TkError
from tk.core.training.precision import LossScaling, Precision, check_precision
from tk.core.training.update import apply_update


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    return model, opt, x


def test_one_check_names_the_problem_and_the_constructor_raises_it():
    assert check_precision("bf16", "cpu") is None and check_precision("fp32", torch.device("cpu")) is None
    assert check_precision("fp16", "cpu") == "train.precision: fp16 needs a CUDA device (got 'cpu'); use bf16 on CPU"
    assert check_precision("fp8", "cpu") == "train.precision must be one of ['bf16', 'fp16', 'fp32'], got 'fp8'"
    with pytest.raises(TkError, match="fp16 needs a CUDA device.*use bf16 on CPU"):
        Precision("fp16", "cpu")
    with pytest.raises(TkError, match="train.precision"):
        Precision("fp8", "cpu")


def test_autocast_dtypes_on_cpu():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with Precision("bf16", "cpu").autocast():
        assert (a @ b).dtype == torch.bfloat16
    with Precision("fp32", "cpu").autocast():
        assert (a @ b).dtype == torch.float32


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_fp32_update_is_scale_clip_step_as_torch_does_it(max_norm):
    model, opt, x = _setup()
    ref = copy.deepcopy(model)
    p = Precision("fp32", "cpu")
    loss = model(x).pow(2).sum()
    p.backward(loss)
    grads = [q.grad for q in model.parameters()]
    update = apply_update(p, opt, grads, loss.detach(), scale=0.125, max_norm=max_norm, extras=[torch.tensor(3.0)])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (ref(x).pow(2).sum() * 0.125).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm is not None else float("inf"))
    ref_opt.step()
    assert update.took_step and update.skipped_because is None and update.extras == [3.0]
    assert update.loss == pytest.approx(loss.item()) and update.grad_norm == pytest.approx(norm.item(), rel=1e-6)
    if max_norm is not None:
        assert update.grad_norm > max_norm  # the clipping really happened
    torch.testing.assert_close(model.weight, ref.weight)
    torch.testing.assert_close(model.bias, ref.bias)
    assert p.skipped_steps == 0 and p.log_record() == {}


def test_an_update_without_gradients_steps_nothing_and_reports_a_zero_norm():
    model, opt, _ = _setup()
    update = apply_update(Precision("fp32", "cpu"), opt, [], torch.tensor(2.0), scale=0.5, max_norm=1.0)
    assert update.took_step and update.grad_norm == 0.0 and update.loss == 2.0


def test_fp32_update_skips_a_nan_gradient_and_says_why():
    model, opt, x = _setup()
    p = Precision("fp32", "cpu")
    loss = model(x).pow(2).sum()
    p.backward(loss)
    model.weight.grad[0, 0] = float("nan")
    before = model.weight.detach().clone()
    update = apply_update(p, opt, [q.grad for q in model.parameters()], loss.detach(), max_norm=1.0)
    assert not update.took_step and update.skipped_because == "non-finite"
    assert torch.equal(model.weight, before)
    assert torch.isnan(model.weight.grad[0, 0]) and torch.isfinite(model.bias.grad).all()  # the culprit stays findable


def test_loss_scaling_unscale_then_skip_on_inf():
    model, opt, x = _setup()
    ref = copy.deepcopy(model)
    ref(x).pow(2).sum().backward()

    scaling = LossScaling(torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1))
    scaling.backward(model(x).pow(2).sum())
    torch.testing.assert_close(model.weight.grad, 1024.0 * ref.weight.grad)  # scaled
    scaling.unscale_(opt)
    scaling.unscale_(opt)  # idempotent within one update
    torch.testing.assert_close(model.weight.grad, ref.weight.grad)  # true grads, ready for clipping
    before = model.weight.detach().clone()
    assert scaling.step(opt) is True
    scaling.update()
    assert not torch.equal(model.weight, before)
    assert scaling.get_scale() == 2048.0  # growth_interval=1: grows after a good step

    # an injected inf gradient: the step is skipped, params unchanged, scale halved
    opt.zero_grad()
    scaling.backward(model(x).pow(2).sum())
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    assert scaling.step(opt) is False
    scaling.update()
    assert torch.equal(model.weight, before)
    assert scaling.skipped_steps == 1 and scaling.get_scale() == 1024.0

    state = scaling.state_dict()
    restored = LossScaling(torch.amp.GradScaler("cpu"))
    restored.load_state_dict(state)
    assert restored.get_scale() == 1024.0 and restored.skipped_steps == 1


def test_precision_delegates_to_loss_scaling():
    model, opt, x = _setup()
    p = Precision("fp32", "cpu")
    p.scaling = LossScaling(torch.amp.GradScaler("cpu", init_scale=8.0))  # the seam fp16 uses on CUDA
    loss = model(x).sum()
    p.backward(loss)
    model.weight.grad[0, 0] = float("inf")  # an overflow from a finite loss: the scaler's business
    update = apply_update(p, opt, [q.grad for q in model.parameters()], loss.detach())
    assert not update.took_step and update.skipped_because == "overflow"
    assert p.skipped_steps == 1 and p.log_record() == {"loss_scale": 4.0}
    opt.zero_grad()
    loss = model(x).sum() * float("nan")
    p.backward(loss)
    update = apply_update(p, opt, [q.grad for q in model.parameters()], loss.detach())
    assert update.skipped_because == "non-finite" and p.skipped_steps == 2
    state = p.state_dict()
    assert state["precision"] == "fp32" and state["scaler"]["scale"] == 2.0


@pytest.mark.gpu
def test_fp16_cuda_step_finite():
    torch.manual_seed(0)
    model = nn.Linear(16, 4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    p = Precision("fp16", "cuda")
    x = torch.randn(8, 16, device="cuda")
    with p.autocast():
        out = model(x)
        assert out.dtype == torch.float16
        loss = out.float().pow(2).mean()
    p.backward(loss)
    before = model.weight.detach().clone()
    update = apply_update(p, opt, [q.grad for q in model.parameters()], loss.detach(), max_norm=1.0)
    assert update.took_step and update.skipped_because is None
    assert torch.isfinite(model.weight).all() and not torch.equal(model.weight, before)
    assert p.log_record()["loss_scale"] == 65536.0


def test_loss_scaling_skips_a_non_finite_loss_even_with_finite_gradients():
    """The GradScaler would apply such a step (it checks gradients only); tk skips it as
    fp32 and bf16 do, and the scale is still updated."""
    model, opt, x = _setup()
    p = Precision("fp32", "cpu")
    p.scaling = LossScaling(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1))
    before = model.weight.detach().clone()
    loss = model(x).sum()
    p.backward(loss)
    update = apply_update(p, opt, [q.grad for q in model.parameters()], torch.tensor(float("inf")))
    assert not update.took_step and update.skipped_because == "non-finite"
    assert torch.equal(model.weight, before) and p.skipped_steps == 1
    assert p.log_record() == {"loss_scale": 16.0}  # no overflow found: the scale grew as usual


def test_a_cpu_item_count_with_the_loss_elsewhere_is_moved_not_an_error():
    model, opt, x = _setup()
    p = Precision("fp32", "cpu")
    loss = model(x).sum()
    loss.backward()
    update = apply_update(p, opt, [q.grad for q in model.parameters()], loss.detach(),
                            extras=[torch.tensor(4.0, dtype=torch.float64)])
    assert update.took_step and update.extras == [4.0]
