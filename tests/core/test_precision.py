"""Tests for tk.core.engine.precision: autocast choice, device errors, and loss-scaling skip logic
(run on CPU through torch.amp.GradScaler("cpu"))."""

import copy

import pytest
import torch
from torch import nn

from tk.core.engine.precision import LossScaling, Precision
from tk.core.errors import TkError


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    return model, opt, x


def test_fp16_on_cpu_and_bad_name_raise():
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


def test_fp32_path_is_plain_backward_and_step():
    model, opt, x = _setup()
    ref = copy.deepcopy(model)
    p = Precision("fp32", "cpu")
    p.backward(model(x).pow(2).sum())
    p.unscale_(opt)
    assert p.step(opt) is True and p.skipped_steps == 0
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).pow(2).sum().backward()
    ref_opt.step()
    torch.testing.assert_close(model.weight, ref.weight)


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
    p.backward(model(x).sum() * float("nan"))
    assert p.step(opt) is False and p.skipped_steps == 1
    p.update()
    state = p.state_dict()
    assert state["precision"] == "fp32" and state["scaler"]["scale"] == 4.0


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
    p.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert p.step(opt) is True
    p.update()
    assert torch.isfinite(model.weight).all()
