"""Tests for tk.core.nn.blocks: encoder/decoder layers match torch's own layers with copied
weights (post-norm and pre-norm, padding and causal masks); no leakage; options."""

import pytest
import torch
from torch import nn

from tk.core.nn.blocks import DecoderLayer, DecoderOnlyLayer, EncoderLayer
from tk.core.nn.config import TransformerConfig
from tk.core.nn.masks import causal_mask


def copy_attn(ours, ref: nn.MultiheadAttention) -> None:
    """nn.MultiheadAttention (packed in_proj rows q, k, v; out_proj) -> tk MultiHeadAttention."""
    if hasattr(ours, "qkv"):
        ours.qkv.weight.copy_(ref.in_proj_weight)
        ours.qkv.bias.copy_(ref.in_proj_bias)
    else:
        ws, bs = ref.in_proj_weight.chunk(3), ref.in_proj_bias.chunk(3)
        for proj, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
    ours.proj.weight.copy_(ref.out_proj.weight)
    ours.proj.bias.copy_(ref.out_proj.bias)


def copy_linear_norm(dst: nn.Module, src: nn.Module) -> None:
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


@torch.no_grad()
def copy_encoder_layer(ours: EncoderLayer, ref: nn.TransformerEncoderLayer) -> None:
    copy_attn(ours.self_attn, ref.self_attn)
    copy_linear_norm(ours.mlp.fc1, ref.linear1)
    copy_linear_norm(ours.mlp.fc2, ref.linear2)
    copy_linear_norm(ours.norm1, ref.norm1)
    copy_linear_norm(ours.norm2, ref.norm2)


@torch.no_grad()
def copy_decoder_layer(ours: DecoderLayer, ref: nn.TransformerDecoderLayer) -> None:
    copy_attn(ours.self_attn, ref.self_attn)
    copy_attn(ours.cross_attn, ref.multihead_attn)
    copy_linear_norm(ours.mlp.fc1, ref.linear1)
    copy_linear_norm(ours.mlp.fc2, ref.linear2)
    for i in (1, 2, 3):
        copy_linear_norm(getattr(ours, f"norm{i}"), getattr(ref, f"norm{i}"))


def _randomise_norms(module: nn.Module) -> None:
    """LayerNorms start as identity; perturb them so a wrong copy cannot pass."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(torch.randn_like(m.weight) * 0.1)
                m.bias.add_(torch.randn_like(m.bias) * 0.1)


D, H, FF = 16, 4, 40


def cfg(**kw) -> TransformerConfig:
    """The paper's layer (post-norm, ReLU, no drop path) of width D, H heads, FFN FF."""
    args = dict(dim=D, num_heads=H, hidden_dim=FF, dropout=0.0, activation="relu", norm_first=False)
    return TransformerConfig(**{**args, **kw})


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_layer_matches_torch(norm_first, activation, causal):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    _randomise_norms(ref)
    ours = EncoderLayer(cfg(activation=activation, norm_first=norm_first))
    copy_encoder_layer(ours, ref)
    ref.eval(), ours.eval()
    x = torch.randn(2, 6, D)
    kpm = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    src_mask = causal_mask(6) if causal else None
    expected = ref(x, src_mask=src_mask, src_key_padding_mask=kpm, is_causal=causal)
    out = ours(x, key_padding_mask=kpm, is_causal=causal)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(1)
    ref = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    _randomise_norms(ref)
    ours = DecoderLayer(cfg(norm_first=norm_first))
    copy_decoder_layer(ours, ref)
    ref.eval(), ours.eval()
    tgt, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    tgt_kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    mem_kpm = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
    expected = ref(
        tgt, mem, tgt_mask=causal_mask(5), tgt_key_padding_mask=tgt_kpm, memory_key_padding_mask=mem_kpm,
        tgt_is_causal=True,
    )
    out = ours(tgt, mem, key_padding_mask=tgt_kpm, memory_key_padding_mask=mem_kpm, is_causal=True)
    assert torch.allclose(out, expected, atol=1e-5)


def test_decoder_layer_no_leakage():
    torch.manual_seed(2)
    layer = DecoderLayer(cfg(hidden_dim=None)).eval()
    tgt, mem = torch.randn(1, 6, D), torch.randn(1, 4, D)
    mem_kpm = torch.tensor([[False, False, True, True]])
    base = layer(tgt, mem, memory_key_padding_mask=mem_kpm)
    for t in range(5):
        tgt2 = tgt.clone()
        tgt2[:, t + 1] += 1.0
        out = layer(tgt2, mem, memory_key_padding_mask=mem_kpm)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)
    mem2 = mem.clone()
    mem2[:, 2:] = torch.randn(2, D)  # padded memory positions
    assert torch.allclose(layer(tgt, mem2, memory_key_padding_mask=mem_kpm), base, atol=1e-6)


def test_decoder_only_layer_is_causal_by_default():
    torch.manual_seed(3)
    layer = DecoderOnlyLayer(cfg(hidden_dim=None, norm_first=True)).eval()
    enc = EncoderLayer(cfg(hidden_dim=None, norm_first=True)).eval()
    enc.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, D)
    assert torch.allclose(layer(x), enc(x, is_causal=True), atol=1e-6)
    assert not torch.allclose(layer(x), enc(x), atol=1e-4)


def test_options_swiglu_rmsnorm_drop_path():
    torch.manual_seed(4)
    options = cfg(hidden_dim=24, activation="swiglu", norm="rmsnorm", norm_first=True, num_kv_heads=2)
    layer = EncoderLayer(options, drop_path=0.5)
    assert layer.mlp.fc1.weight.shape == (48, D)
    x = torch.randn(8, 3, D, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    layer.eval()
    assert torch.allclose(layer(x), layer(x))


def test_errors():
    with pytest.raises(ValueError, match=r"dim \(10\) must be divisible by num_heads \(3\)"):
        EncoderLayer(TransformerConfig(dim=10, num_heads=3))
    with pytest.raises(ValueError, match="activation"):
        DecoderLayer(TransformerConfig(dim=8, num_heads=2, activation="elu"))


SELF_LAYER_KEYS = ["mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias", "norm1.weight", "norm1.bias",
                   "norm2.weight", "norm2.bias", "self_attn.qkv.weight", "self_attn.qkv.bias",
                   "self_attn.proj.weight", "self_attn.proj.bias"]
CROSS_KEYS = [f"cross_attn.{p}.{k}" for p in ("q_proj", "k_proj", "v_proj", "proj") for k in ("weight", "bias")]
DECODER_LAYER_KEYS = [*SELF_LAYER_KEYS[:8], "norm3.weight", "norm3.bias", *SELF_LAYER_KEYS[8:], *CROSS_KEYS]


@pytest.mark.parametrize("layer_cls, keys", [(EncoderLayer, SELF_LAYER_KEYS), (DecoderOnlyLayer, SELF_LAYER_KEYS),
                                             (DecoderLayer, DECODER_LAYER_KEYS)])
def test_state_dict_keys_and_their_order_are_stable(layer_cls, keys):
    """Checkpoints load by name, and optimiser states by parameter order: both stay as released."""
    layer = layer_cls(TransformerConfig(dim=8, depth=1, num_heads=2))
    assert list(layer.state_dict()) == keys
