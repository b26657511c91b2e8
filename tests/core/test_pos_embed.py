"""Tests for tk.core.nn.pos_embed: known sinusoidal values, length errors, RoPE, resampling."""

import math

import pytest
import torch

from tk.core.nn.attention import KVCache, MultiHeadAttention
from tk.core.nn.pos_embed import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    resample_pos_embed,
    sinusoidal_table,
)


def test_sinusoidal_known_values():
    pe = SinusoidalPositionalEncoding(4, max_len=10)
    out = pe(torch.zeros(1, 3, 4))
    assert torch.allclose(out[0, 2], torch.tensor([0.9093, -0.4161, 0.0200, 0.9998]), atol=1e-4)
    assert torch.equal(out[0, 0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert "pe" not in pe.state_dict() and len(list(pe.parameters())) == 0  # buffer, not parameter


def test_sinusoidal_formula_and_offset_and_extrapolation():
    d = 6
    table = sinusoidal_table(20, d)
    pos, i = 13, 2
    assert math.isclose(table[pos, 2 * i].item(), math.sin(pos / 10000 ** (2 * i / d)), abs_tol=1e-6)
    assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(pos / 10000 ** (2 * i / d)), abs_tol=1e-6)
    pe = SinusoidalPositionalEncoding(d, max_len=8)
    x = torch.zeros(2, 5, d)
    assert torch.allclose(pe(x, offset=3)[0], table[3:8])
    assert torch.allclose(pe(torch.zeros(1, 20, d))[0], table, atol=1e-6)  # beyond max_len: computed
    assert sinusoidal_table(3, 5).shape == (3, 5)


def test_learned_too_long_raises():
    torch.manual_seed(0)
    lpe = LearnedPositionalEmbedding(8, 4)
    assert torch.equal(lpe(torch.zeros(1, 3, 4), offset=2)[0], lpe.weight[2:5])
    with pytest.raises(ValueError, match=r"sequence length \(9\) exceeds max_len \(8\).*larger max_len"):
        lpe(torch.zeros(1, 9, 4))
    with pytest.raises(ValueError, match=r"sequence length \(9\)"):
        lpe(torch.zeros(1, 1, 4), offset=8)


def test_per_token_positions():
    """(B, T) positions pick table rows per token; the table length is checked against
    offset + T (positions never exceed it), beyond the table a sinusoidal encoding computes
    the same values on the fly."""
    torch.manual_seed(0)
    positions = torch.tensor([[0, 0, 1], [4, 5, 6]])
    lpe = LearnedPositionalEmbedding(8, 4)
    assert torch.equal(lpe(torch.zeros(2, 3, 4), 4, positions), lpe.weight[positions])
    with pytest.raises(ValueError, match=r"sequence length \(9\) exceeds max_len \(8\)"):
        lpe(torch.zeros(1, 1, 4), 8, torch.tensor([[8]]))
    spe = SinusoidalPositionalEncoding(6, max_len=5)
    far = torch.tensor([[3, 7, 11]])  # crosses the 5-row table
    assert torch.allclose(spe(torch.zeros(1, 3, 6), 9, far)[0], sinusoidal_table(12, 6)[far[0]], atol=1e-6)
    near = torch.tensor([[0, 0, 1], [0, 1, 2]])  # inside the table
    assert torch.equal(spe(torch.zeros(2, 3, 6), 0, near), spe.pe[near])


def test_token_embedding_scaled():
    torch.manual_seed(1)
    emb = TokenEmbedding(10, 16, padding_idx=0)
    tok = torch.tensor([[3, 0]])
    assert torch.allclose(emb(tok)[0, 0], emb.weight[3] * 4.0)
    assert torch.equal(emb(tok)[0, 1], torch.zeros(16))
    unscaled = TokenEmbedding(10, 16, scale=False)
    assert torch.equal(unscaled(tok)[0, 0], unscaled.weight[3])


def test_rotary_matches_complex_formulation():
    torch.manual_seed(2)
    Dh, T = 8, 5
    rope = RotaryEmbedding(Dh)
    x = torch.randn(1, 2, T, Dh)
    out = rope(x, offset=3)
    z = torch.complex(x[..., : Dh // 2], x[..., Dh // 2 :])  # pair channel j with j + Dh/2
    theta = 10000.0 ** (-torch.arange(0, Dh, 2).float() / Dh)
    pos = torch.arange(3, 3 + T).float()[:, None]
    zr = z * torch.polar(torch.ones_like(pos * theta), pos * theta)
    assert torch.allclose(out, torch.cat([zr.real, zr.imag], -1), atol=1e-5)
    with pytest.raises(ValueError, match=r"head_dim \(7\) must be even"):
        RotaryEmbedding(7)


def test_rotary_scores_depend_on_relative_position():
    torch.manual_seed(3)
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (rope(q, 10) * rope(k, 7)).sum()
    s2 = (rope(q, 103) * rope(k, 100)).sum()
    assert torch.allclose(s1, s2, atol=1e-4)


def test_rotary_attention_cached_matches_full():
    torch.manual_seed(4)
    mha = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8)).eval()
    x = torch.randn(2, 6, 16)
    full = mha(x, is_causal=True)
    cache = KVCache(max_len=6)
    with torch.no_grad():
        steps = [mha(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(6)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_resample_keeps_prefix_and_matches_timm():
    torch.manual_seed(5)
    pos = torch.randn(1, 1 + 4 * 4, 8)
    out = resample_pos_embed(pos, (6, 5), num_prefix_tokens=1)
    assert out.shape == (1, 1 + 30, 8)
    assert torch.equal(out[:, :1], pos[:, :1])
    assert resample_pos_embed(pos, (4, 4)) is pos
    timm_layers = pytest.importorskip("timm.layers")
    ref = timm_layers.resample_abs_pos_embed(pos, (6, 5), num_prefix_tokens=1)
    assert torch.allclose(out, ref, atol=1e-5)
    down = resample_pos_embed(pos, (2, 2))
    assert torch.allclose(down, timm_layers.resample_abs_pos_embed(pos, (2, 2)), atol=1e-5)


def test_resample_constant_grid_stays_constant():
    pos = torch.cat([torch.zeros(1, 2, 3), torch.full((1, 9, 3), 0.5)], dim=1)
    out = resample_pos_embed(pos, (5, 5), old_grid=(3, 3), num_prefix_tokens=2)
    assert torch.allclose(out[:, 2:], torch.full((1, 25, 3), 0.5), atol=1e-5)


def test_resample_errors():
    with pytest.raises(ValueError, match="square grid from 15"):
        resample_pos_embed(torch.randn(1, 16, 4), (4, 4), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"old_grid \(3, 4\) has 12 cells but pos_embed has 16"):
        resample_pos_embed(torch.randn(1, 17, 4), (4, 4), old_grid=(3, 4))
