"""Tests for tk.core.nn.attention: numerics vs hand computation and nn.MultiheadAttention,
fused vs reference agreement, masking edge cases and the KV cache."""

import pytest
import torch
from torch import nn

from tk.core.nn.attention import KVCache, MultiHeadAttention, attention_reference, scaled_dot_product_attention
from tk.core.nn.masks import causal_mask, padding_mask

HAND_X = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
HAND_W = [[0.4011, 0.1978, 0.4011], [0.1978, 0.4011, 0.4011], [0.2483, 0.2483, 0.5035]]
HAND_OUT = [[0.8022, 0.5989], [0.5989, 0.8022], [0.7517, 0.7517]]


def copy_from_torch_mha(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    """Copy nn.MultiheadAttention's packed in_proj (rows q, k, v) and out_proj into ours."""
    with torch.no_grad():
        if hasattr(ours, "qkv"):
            ours.qkv.weight.copy_(ref.in_proj_weight)
            ours.qkv.bias.copy_(ref.in_proj_bias)
        else:
            for proj, w, b in zip(
                (ours.q_proj, ours.k_proj, ours.v_proj),
                ref.in_proj_weight.chunk(3), ref.in_proj_bias.chunk(3),
            ):
                proj.weight.copy_(w)
                proj.bias.copy_(b)
        ours.proj.weight.copy_(ref.out_proj.weight)
        ours.proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("path", ["fused", "reference"])
def test_hand_worked_example(path):
    x = torch.tensor([HAND_X])[:, None]  # (B=1, H=1, T=3, Dh=2); W_Q = W_K = W_V = I
    if path == "fused":
        out, _ = scaled_dot_product_attention(x, x, x)
        _, w = attention_reference(x, x, x)
    else:
        out, w = scaled_dot_product_attention(x, x, x, need_weights=True)
    assert torch.allclose(w[0, 0], torch.tensor(HAND_W), atol=1e-4)
    assert torch.allclose(out[0, 0], torch.tensor(HAND_OUT), atol=1e-4)


@pytest.mark.parametrize("fused_attn", [True, False])
def test_hand_worked_example_through_module(fused_attn):
    mha = MultiHeadAttention(2, 1)
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.eye(2).repeat(3, 1))
        mha.qkv.bias.zero_()
        mha.proj.weight.copy_(torch.eye(2))
        mha.proj.bias.zero_()
    mha.fused_attn = fused_attn
    out, w = mha(torch.tensor([HAND_X]), need_weights=True)
    assert torch.allclose(w[0, 0], torch.tensor(HAND_W), atol=1e-4)
    assert torch.allclose(out[0], torch.tensor(HAND_OUT), atol=1e-4)
    assert torch.allclose(mha(torch.tensor([HAND_X]))[0], torch.tensor(HAND_OUT), atol=1e-4)


@pytest.mark.parametrize("cross", [False, True])
def test_matches_torch_multihead_attention(cross):
    torch.manual_seed(0)
    B, Tq, Tk, D, H = 2, 5, 7 if cross else 5, 16, 4
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    ours = MultiHeadAttention(D, H, cross_attention=cross).eval()
    copy_from_torch_mha(ours, ref)
    x = torch.randn(B, Tq, D)
    ctx = torch.randn(B, Tk, D) if cross else x
    kpm = torch.zeros(B, Tk, dtype=torch.bool)
    kpm[0, -2:] = True
    attn_mask = torch.rand(Tq, Tk) > 0.7
    attn_mask[:, 0] = False  # keep every row attendable so torch gives no NaN
    ref_out, ref_w = ref(x, ctx, ctx, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
    out, w = ours(x, ctx if cross else None, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=True)
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert torch.allclose(w, ref_w, atol=1e-5)
    out_fused = ours(x, ctx if cross else None, attn_mask=attn_mask, key_padding_mask=kpm)
    assert torch.allclose(out_fused, ref_out, atol=1e-5)


def test_matches_torch_with_causal_mask():
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(12, 3, batch_first=True).eval()
    ours = MultiHeadAttention(12, 3).eval()
    copy_from_torch_mha(ours, ref)
    x = torch.randn(3, 6, 12)
    ref_out, _ = ref(x, x, x, attn_mask=causal_mask(6))
    assert torch.allclose(ours(x, is_causal=True), ref_out, atol=1e-5)
    assert torch.allclose(ours(x, attn_mask=causal_mask(6)), ref_out, atol=1e-5)


def _random_qkv(B=2, H=4, Hkv=4, Tq=6, Tk=6, Dh=8, grad=False):
    q = torch.randn(B, H, Tq, Dh, requires_grad=grad)
    k = torch.randn(B, Hkv, Tk, Dh, requires_grad=grad)
    v = torch.randn(B, Hkv, Tk, Dh, requires_grad=grad)
    return q, k, v


@pytest.mark.parametrize(
    "case", ["none", "causal", "padding", "padding+causal", "per_head", "gqa_causal", "causal_fewer_queries"]
)
def test_fused_matches_reference(case):
    torch.manual_seed(2)
    Hkv = 2 if case.startswith("gqa") else 4
    Tq = 3 if case == "causal_fewer_queries" else 6
    q, k, v = _random_qkv(Hkv=Hkv, Tq=Tq, grad=True)
    mask = None
    if "padding" in case:
        mask = padding_mask(torch.tensor([[1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 5, 6]]), 0)[:, None, None, :]
    if case == "per_head":
        mask = torch.rand(2, 4, 6, 6) > 0.5
    is_causal = "causal" in case
    out_f, _ = scaled_dot_product_attention(q, k, v, mask, is_causal)
    out_r, _ = attention_reference(q, k, v, mask, is_causal)
    assert torch.allclose(out_f, out_r, atol=1e-5)
    g = torch.randn_like(out_f)
    grads_f = torch.autograd.grad(scaled_dot_product_attention(q, k, v, mask, is_causal)[0], (q, k, v), g)
    grads_r = torch.autograd.grad(attention_reference(q, k, v, mask, is_causal)[0], (q, k, v), g)
    for a, b in zip(grads_f, grads_r):
        assert torch.allclose(a, b, atol=1e-5)


def test_pure_causal_uses_sdpa_is_causal(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = _random_qkv()
    scaled_dot_product_attention(q, k, v, is_causal=True)
    scaled_dot_product_attention(q[:, :, -1:], k, v, is_causal=True)  # one cached-decoding query
    assert calls == [(None, True), (None, False)]  # no materialised mask in either case


def test_causal_with_fewer_queries_is_bottom_right():
    torch.manual_seed(3)
    q, k, v = _random_qkv(Tq=6, Tk=6)
    full, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
    last2, _ = scaled_dot_product_attention(q[:, :, -2:], k, v, is_causal=True)
    last1, _ = scaled_dot_product_attention(q[:, :, -1:], k, v, is_causal=True)
    assert torch.allclose(last2, full[:, :, -2:], atol=1e-5)
    assert torch.allclose(last1, full[:, :, -1:], atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_rows_are_zero_and_finite(need_weights):
    torch.manual_seed(4)
    q, k, v = _random_qkv(grad=True)
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    mask[0, :, 2, :] = True  # one query row sees nothing
    mask[1, :, :, :] = True  # a whole sequence sees nothing
    out, w = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    if need_weights:
        assert torch.equal(w[1], torch.zeros_like(w[1]))
    (out.sum() + out.pow(2).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


def test_fully_padded_sequence_through_module():
    torch.manual_seed(5)
    mha = MultiHeadAttention(16, 4, proj_bias=False)
    x = torch.randn(2, 4, 16, requires_grad=True)
    kpm = torch.tensor([[False, False, True, True], [True, True, True, True]])
    for fused in (True, False):
        mha.fused_attn = fused
        out = mha(x, key_padding_mask=kpm)
        assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
        out.sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(mha.qkv.weight.grad).all()


def test_no_causal_leakage():
    torch.manual_seed(6)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 8, 16)
    base = mha(x, is_causal=True)
    for t in range(7):
        x2 = x.clone()
        x2[:, t + 1] += torch.randn(16)
        out = mha(x2, is_causal=True)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)
        assert not torch.allclose(out[:, t + 1], base[:, t + 1], atol=1e-4)


def test_no_padding_leakage():
    torch.manual_seed(7)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    kpm = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    base = mha(x, key_padding_mask=kpm)
    x2 = x.clone()
    x2[0, 4:] = torch.randn(2, 16)  # change the padded positions only
    out = mha(x2, key_padding_mask=kpm)
    assert torch.allclose(out[0, :4], base[0, :4], atol=1e-6)
    assert torch.allclose(out[1], base[1], atol=1e-6)


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(8)
    D, H, Hkv = 16, 4, 2
    gqa = MultiHeadAttention(D, H, num_kv_heads=Hkv, fused_qkv=False).eval()
    mha = MultiHeadAttention(D, H, fused_qkv=False).eval()
    Dh = D // H
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.proj.load_state_dict(gqa.proj.state_dict())
        for src, dst in ((gqa.k_proj, mha.k_proj), (gqa.v_proj, mha.v_proj)):
            dst.weight.copy_(src.weight.view(Hkv, Dh, D).repeat_interleave(H // Hkv, 0).reshape(D, D))
            dst.bias.copy_(src.bias.view(Hkv, Dh).repeat_interleave(H // Hkv, 0).reshape(D))
    x = torch.randn(2, 5, D)
    assert torch.allclose(gqa(x, is_causal=True), mha(x, is_causal=True), atol=1e-5)
    assert gqa.k_proj.weight.shape == (Hkv * Dh, D)


def test_errors():
    with pytest.raises(ValueError, match=r"dim \(10\) must be divisible by num_heads \(4\)"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        MultiHeadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="cross_attention=True"):
        MultiHeadAttention(16, 4)(torch.randn(1, 2, 16), torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="needs `context`"):
        MultiHeadAttention(16, 4, cross_attention=True)(torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match=r"static=False"):
        MultiHeadAttention(16, 4)(torch.randn(1, 2, 16), cache=KVCache(static=True))


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_kv_cache_incremental_matches_full(num_kv_heads):
    torch.manual_seed(9)
    mha = MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads).eval()
    x = torch.randn(2, 9, 16)
    full = mha(x, is_causal=True)
    cache = KVCache(max_len=4)  # forces growth beyond the preallocation
    with torch.no_grad():
        steps = [mha(x[:, :3], is_causal=True, cache=cache)]  # prefill 3 tokens
        steps += [mha(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(3, 9)]
    assert cache.length == 9
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_kv_cache_reorder_and_static_cross():
    torch.manual_seed(10)
    self_attn = MultiHeadAttention(16, 4).eval()
    cross = MultiHeadAttention(16, 4, cross_attention=True).eval()
    x, mem = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    idx = torch.tensor([2, 2, 0])
    sc, cc = KVCache(max_len=8), KVCache(static=True)
    with torch.no_grad():
        for t in range(3):
            self_attn(x[:, t : t + 1], is_causal=True, cache=sc)
            cross(x[:, t : t + 1], mem, cache=cc)
        sc.reorder(idx)
        cc.reorder(idx)
        xr = x[idx]
        step = self_attn(xr[:, 3:4], is_causal=True, cache=sc)
        cstep = cross(xr[:, 3:4], None, cache=cc)  # context not needed once cached
    full = self_attn(xr[:, :4], is_causal=True)
    assert torch.allclose(step[:, 0], full[:, 3], atol=1e-5)
    assert torch.allclose(cstep, cross(xr[:, 3:4], mem[idx]), atol=1e-5)
    assert cc.length == 7
