"""Tests for tk.core.nn.layers: Mlp (timm names, SwiGLU), DropPath, RMSNorm, build_norm."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tk.core.nn.layers import DropPath, Mlp, RMSNorm, build_norm


def test_mlp_matches_timm_mlp_state_dict():
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    ref = timm_layers.Mlp(16, 40).eval()
    ours = Mlp(16, 40, activation="gelu").eval()
    ours.load_state_dict(ref.state_dict())  # same parameter names: fc1, fc2
    x = torch.randn(2, 5, 16)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_mlp_relu_by_hand():
    torch.manual_seed(1)
    m = Mlp(4, 8, activation="relu")
    x = torch.randn(3, 4)
    expected = F.linear(F.relu(F.linear(x, m.fc1.weight, m.fc1.bias)), m.fc2.weight, m.fc2.bias)
    assert torch.allclose(m(x), expected, atol=1e-6)


def test_swiglu_layout():
    torch.manual_seed(2)
    m = Mlp(4, 6, activation="swiglu", bias=False)
    assert m.fc1.weight.shape == (12, 4) and m.fc2.weight.shape == (4, 6)
    x = torch.randn(3, 4)
    w1, w3 = m.fc1.weight[:6], m.fc1.weight[6:]  # gate, value
    expected = (F.silu(x @ w1.T) * (x @ w3.T)) @ m.fc2.weight.T
    assert torch.allclose(m(x), expected, atol=1e-6)


def test_mlp_bad_activation():
    with pytest.raises(ValueError, match=r"activation \('tanh'\) must be one of"):
        Mlp(4, 8, activation="tanh")


def test_drop_path_per_sample_and_scaled():
    torch.manual_seed(3)
    dp = DropPath(0.5)
    x = torch.ones(1000, 3)
    y = dp(x)
    rows = y[:, 0]
    assert set(rows.unique().tolist()) <= {0.0, 2.0}  # whole samples dropped, kept ones scaled 1/(1-p)
    assert torch.equal(y, rows[:, None].expand(-1, 3))
    assert 0.4 < (rows == 0).float().mean() < 0.6
    dp.eval()
    assert torch.equal(dp(x), x)
    with pytest.raises(ValueError, match=r"\(1.0\) must be in \[0, 1\)"):
        DropPath(1.0)


def test_rmsnorm_matches_torch():
    torch.manual_seed(4)
    ours, ref = RMSNorm(8, eps=1e-6), nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8))
        ref.weight.copy_(ours.weight)
    x = torch.randn(2, 3, 8)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert ours(x.bfloat16()).dtype == torch.bfloat16


def test_build_norm():
    assert isinstance(build_norm("layernorm", 8), nn.LayerNorm)
    assert isinstance(build_norm("rmsnorm", 8, 1e-6), RMSNorm)
    with pytest.raises(ValueError, match=r"norm \('batchnorm'\) must be one of"):
        build_norm("batchnorm", 8)
