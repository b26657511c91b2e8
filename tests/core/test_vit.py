"""Tests for tk.core.nn.vit: timm parity, position-embedding resampling, DeiT heads, hooks."""

import pytest
import timm
import torch

from tk.core.nn.config import ViTConfig
from tk.core.nn.vit import ConvStem, VisionTransformer, convert_timm_vit_state_dict, load_timm_vit
from tk.core.optim import OptimConfig, build_optimizer, param_groups


def _tiny(**kw):
    args = dict(img_size=32, patch_size=8, num_classes=5, dim=32, depth=2, num_heads=4)
    args.update(kw)
    return VisionTransformer(**args)


def test_matches_timm_vit_logits():
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10).eval()
    model = VisionTransformer(img_size=32, patch_size=4, num_classes=10, dim=192, depth=12, num_heads=3).eval()
    load_timm_vit(model, ref)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_mean_pooling_matches_timm_avg_pool():
    torch.manual_seed(1)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=7,
                            depth=2, global_pool="avg").eval()
    sd = ref.state_dict()
    assert "fc_norm.weight" in sd  # timm normalises after pooling; tk maps fc_norm -> norm
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=7, dim=192, depth=2, num_heads=3,
                              pooling="mean").eval()
    load_timm_vit(model, sd)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_distilled_matches_timm_deit_and_returns_pair_in_training():
    torch.manual_seed(2)
    ref = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8,
                            num_classes=6, depth=2).eval()
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=6, dim=192, depth=2, num_heads=3,
                              distilled=True).eval()
    load_timm_vit(model, ref)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
        model.train()
        cls_logits, dist_logits = model(x)  # no dropout/drop-path: same numbers as eval
        torch.testing.assert_close((cls_logits + dist_logits) / 2, ref(x), atol=1e-5, rtol=1e-5)
    assert model.no_weight_decay() >= {"pos_embed", "cls_token", "dist_token"}


def test_pos_embed_resampling_keeps_prefix_tokens():
    torch.manual_seed(3)
    model = _tiny(distilled=True).eval()
    old = model.pos_embed.detach().clone()  # (1, 2 + 16, D)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        on_the_fly = model(x)  # resampled per call for a 6x6 grid
    model.set_img_size(48)
    assert model.pos_embed.shape == (1, 2 + 36, 32)
    assert torch.equal(model.pos_embed[:, :2], old[:, :2])
    with torch.no_grad():
        torch.testing.assert_close(model(x), on_the_fly)
    # a constant grid stays constant under bicubic resampling
    const = _tiny()
    with torch.no_grad():
        const.pos_embed[:, 1:] = 0.5
    const.set_img_size(64)
    torch.testing.assert_close(const.pos_embed[:, 1:], torch.full((1, 64, 32), 0.5))


def test_load_timm_resamples_pos_embed_for_another_size():
    torch.manual_seed(4)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=3, depth=1)
    model = VisionTransformer(img_size=64, patch_size=8, num_classes=3, dim=192, depth=1, num_heads=3)
    load_timm_vit(model, ref)
    assert model.pos_embed.shape == (1, 1 + 64, 192)
    torch.testing.assert_close(model.pos_embed[:, :1], ref.pos_embed[:, :1])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by num_heads \(4\)"):
        _tiny(dim=30)
    with pytest.raises(ValueError, match=r"img_size \(30\) must be divisible by patch_size \(8\)"):
        _tiny(img_size=30)
    with pytest.raises(ValueError, match="pooling"):
        _tiny(pooling="max")
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10, depth=2)
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=5, dim=192, depth=2, num_heads=3)
    with pytest.raises(ValueError, match=r"'head.weight'.*\(10, 192\).*\(5, 192\)"):
        load_timm_vit(model, ref)
    with pytest.raises(ValueError, match="missing"):
        load_timm_vit(VisionTransformer(img_size=32, patch_size=8, num_classes=10, dim=192, depth=3, num_heads=3), ref)
    reg = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1, reg_tokens=2)
    with pytest.raises(ValueError, match="reg_token"):
        convert_timm_vit_state_dict(reg.state_dict())


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(5)
    model = _tiny()
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)


def test_drop_path_schedule_and_no_decay_groups():
    model = _tiny(depth=3, drop_path_rate=0.2)
    assert [b.drop_path1.p for b in model.blocks] == pytest.approx([0.0, 0.1, 0.2])
    groups = param_groups(model, OptimConfig(weight_decay=0.05))
    no_decay = {n for g in groups if g["weight_decay"] == 0.0 for n in g["param_names"]}
    assert {"pos_embed", "cls_token", "norm.weight", "head.bias"} <= no_decay
    assert "blocks.0.attn.qkv.weight" not in no_decay


def test_layer_decay_gives_each_block_its_hand_computed_lr():
    model = _tiny(depth=4)
    opt = build_optimizer(model, OptimConfig(lr=1e-3, layer_decay=0.75))
    lr = {name: g["lr"] for g in opt.param_groups for name in g["param_names"]}
    assert model.num_layers() == 5  # embeddings 0, blocks 1..4, head 5
    # 0.75 ** (5 - (i + 1)) for blocks 0..3: 0.75^4, 0.75^3, 0.75^2, 0.75^1
    for i, scale in enumerate([0.31640625, 0.421875, 0.5625, 0.75]):
        block = [n for n in lr if n.startswith(f"blocks.{i}.")]
        assert len(block) == 12 and all(lr[n] == pytest.approx(1e-3 * scale) for n in block)
    for name in ("patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed"):
        assert lr[name] == pytest.approx(1e-3 * 0.2373046875)  # 0.75^5
    for name in ("norm.weight", "norm.bias", "head.weight", "head.bias"):
        assert lr[name] == pytest.approx(1e-3)
    assert len(lr) == len(list(model.parameters()))


def test_built_from_a_config_with_overrides():
    cfg = ViTConfig(dim=32, depth=2, num_heads=4, patch_size=8, mlp_ratio=2.0, bias=False, attn_dropout=0.1,
                    norm="rmsnorm")
    model = VisionTransformer(cfg, img_size=32, num_classes=5, drop_path_rate=0.2)
    assert model.cfg.drop_path_rate == 0.2 and cfg.drop_path_rate == 0.0  # the caller's config is not changed
    block = model.blocks[1]
    assert block.attn.qkv.bias is None and block.mlp.fc1.weight.shape == (64, 32)
    assert block.attn.attn_dropout == 0.1 and block.drop_path1.p == pytest.approx(0.2)
    assert type(block.norm1).__name__ == "RMSNorm" and type(model.norm).__name__ == "RMSNorm"
    with pytest.raises(TypeError, match="drop_rate"):
        VisionTransformer(cfg, drop_rate=0.1)


def test_conv_stem_gives_the_patch_grid_with_overlapping_convolutions():
    """stem: conv: log2(P) 3x3 stride-2 convs (BN, ReLU), widths doubling to D, then a 1x1
    projection: the same (B, N, D) tokens as the patch stem; a pixel changes the tokens of its
    patch and (overlap) the neighbouring ones; positions and everything after are unchanged."""
    stem = ConvStem(img_size=32, patch_size=8, in_chans=3, dim=64).eval()
    convs = [m for m in stem.convs if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.stride) for c in convs] == [(3, 16, (2, 2)), (16, 32, (2, 2)),
                                                                         (32, 64, (2, 2))]
    x = torch.randn(2, 3, 32, 32)
    y = x.clone()
    y[:, :, 7, 7] += 1.0  # the last pixel of patch (0, 0): overlapping 3x3 windows reach the next patches
    with torch.no_grad():
        a, b = stem(x), stem(y)
    assert a.shape == (2, 16, 64)
    changed = ((a - b).abs().amax(dim=(0, 2)) > 0).nonzero().flatten().tolist()
    assert changed == [0, 1, 4, 5]  # patches (0, 0), (0, 1), (1, 0), (1, 1) of the 4 x 4 grid
    model = VisionTransformer(ViTConfig(dim=64, depth=1, num_heads=4, patch_size=8, stem="conv"), img_size=32,
                              num_classes=3)
    assert model.pos_embed.shape == (1, 17, 64) and model(x).shape == (2, 3)
    assert model.layer_id("patch_embed.convs.0.weight") == 0
    for bad in (6, 1):
        with pytest.raises(ValueError, match=r"stem 'conv' needs patch_size to be a power of two"):
            VisionTransformer(ViTConfig(dim=64, depth=1, num_heads=4, patch_size=bad, stem="conv"), img_size=48)
