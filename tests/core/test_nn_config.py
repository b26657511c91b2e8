"""Tests for tk.core.nn.config: a recipe's ``model:`` mapping read into TransformerConfig reaches
every layer of every stack (encoder, decoder, encoder-decoder, decoder-only), field by field;
``check()`` names each broken rule."""

import dataclasses

import pytest
import torch
from torch import nn

from tk.core.config import build_dataclass
from tk.core.nn.config import TransformerConfig, ViTConfig
from tk.core.nn.layers import RMSNorm, SwiGLUAct
from tk.core.nn.pos_embed import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding
from tk.core.nn.transformer import DecoderOnlyLM, EncoderDecoder, TransformerDecoder, TransformerEncoder

# Two recipe-style sections that differ in every field.
PAPER = {
    "dim": 24, "depth": 3, "encoder_depth": 2, "num_heads": 4, "mlp_ratio": 2.5, "activation": "relu",
    "norm": "layernorm", "norm_eps": 1e-5, "norm_first": False, "bias": True, "dropout": 0.1,
    "attn_dropout": 0.2, "mlp_dropout": 0.3, "drop_path_rate": 0.2, "pos_encoding": "learned", "max_len": 40,
    "tie_embeddings": True, "share_embeddings": True,
}
LLAMA = {
    "dim": 32, "depth": 3, "decoder_depth": 2, "num_heads": 4, "num_kv_heads": 2, "hidden_dim": 48,
    "activation": "swiglu", "norm": "rmsnorm", "norm_eps": 1e-6, "norm_first": True, "final_norm": True,
    "bias": False, "dropout": 0.05, "drop_path_rate": 0.1, "pos_encoding": "rotary", "tie_embeddings": False,
}


def read_section(raw: dict) -> TransformerConfig:
    errors: list[str] = []
    cfg = build_dataclass(TransformerConfig, raw, "model", errors)
    assert errors == [] and cfg.check() == []
    return cfg


def expected_drop_path(rate: float, depth: int) -> list[float]:
    return [rate * i / (depth - 1) for i in range(depth)]  # linear from 0 to rate (depth > 1 here)


def check_layer(layer: nn.Module, raw: dict, drop_path: float) -> None:
    """Every per-layer field of ``raw`` is where it belongs in ``layer``."""
    dim, heads = raw["dim"], raw["num_heads"]
    hidden = raw.get("hidden_dim") or int(dim * raw.get("mlp_ratio", 4.0))
    dropout = raw["dropout"]
    assert layer.norm_first is raw["norm_first"]
    assert layer.drop_path.p == pytest.approx(drop_path)
    norms = [m for name, m in layer.named_children() if name.startswith("norm")]
    norm_cls = RMSNorm if raw["norm"] == "rmsnorm" else nn.LayerNorm
    assert norms and all(isinstance(n, norm_cls) and n.eps == raw["norm_eps"] for n in norms)
    act = {"relu": nn.ReLU, "gelu": nn.GELU, "swiglu": SwiGLUAct}[raw["activation"]]
    assert isinstance(layer.mlp.act, act)
    assert layer.mlp.fc1.weight.shape == ((2 if raw["activation"] == "swiglu" else 1) * hidden, dim)
    assert layer.mlp.drop1.p == raw.get("mlp_dropout", dropout)
    assert layer.mlp.drop2.p == dropout
    assert (layer.mlp.fc1.bias is not None) is raw["bias"]
    for attn in [layer.self_attn] + ([layer.cross_attn] if hasattr(layer, "cross_attn") else []):
        assert attn.num_heads == heads and attn.num_kv_heads == raw.get("num_kv_heads", heads)
        assert attn.attn_dropout == raw.get("attn_dropout", dropout)
        assert attn.proj_dropout.p == dropout
        assert (attn.proj.bias is not None) is raw["bias"]
    assert isinstance(layer.self_attn.rotary, RotaryEmbedding) is (raw["pos_encoding"] == "rotary")


def check_stack(stack: nn.Module, raw: dict, depth: int) -> None:
    assert len(stack.layers) == depth
    for layer, p in zip(stack.layers, expected_drop_path(raw["drop_path_rate"], depth)):
        check_layer(layer, raw, p)
    final = raw.get("final_norm", raw["norm_first"])
    assert isinstance(stack.norm, nn.Identity) is (not final)
    if raw["pos_encoding"] == "rotary":  # one rotary module shared by the stack's layers
        assert len({id(layer.self_attn.rotary) for layer in stack.layers}) == 1


def check_positions(pos: nn.Module | None, raw: dict) -> None:
    kind = raw["pos_encoding"]
    if kind == "rotary":
        assert pos is None
    elif kind == "learned":
        assert isinstance(pos, LearnedPositionalEmbedding) and pos.max_len == raw.get("max_len", 1024)
    else:
        assert isinstance(pos, SinusoidalPositionalEncoding)


@pytest.mark.parametrize("raw", [PAPER, LLAMA], ids=["paper", "llama"])
def test_every_field_reaches_every_stack(raw):
    torch.manual_seed(0)
    cfg = read_section(raw)
    enc_depth, dec_depth = raw.get("encoder_depth", raw["depth"]), raw.get("decoder_depth", raw["depth"])
    check_stack(TransformerEncoder(cfg), raw, enc_depth)
    check_stack(TransformerDecoder(cfg), raw, dec_depth)

    seq2seq = EncoderDecoder(cfg, 30, 30, pad_id=0)
    check_stack(seq2seq.encoder, raw, enc_depth)
    check_stack(seq2seq.decoder, raw, dec_depth)
    check_positions(seq2seq.src_pos, raw)
    check_positions(seq2seq.tgt_pos, raw)
    assert (seq2seq.src_embed is seq2seq.tgt_embed) is raw.get("share_embeddings", False)
    assert (seq2seq.lm_head.weight is seq2seq.tgt_embed.weight) is raw["tie_embeddings"]
    assert seq2seq.embed_drop.p == raw["dropout"]

    lm = DecoderOnlyLM(cfg, 30, pad_id=0)
    check_stack(lm.decoder, raw, raw["depth"])
    assert all(type(layer).default_causal for layer in lm.decoder.layers)
    check_positions(lm.pos, raw)
    assert (lm.lm_head.weight is lm.tok_embed.weight) is raw["tie_embeddings"]
    assert lm.embed_drop.p == raw["dropout"]

    # ...and the models run with them
    src, tgt = torch.randint(1, 30, (2, 5)), torch.randint(1, 30, (2, 4))
    assert seq2seq(src, tgt).shape == (2, 4, 30) and lm(tgt).shape == (2, 4, 30)


def test_no_positions_and_default_ffn():
    cfg = TransformerConfig(dim=16, depth=1, num_heads=2, pos_encoding="none")
    lm = DecoderOnlyLM(cfg, 11)
    assert lm.pos is None and lm.decoder.layers[0].self_attn.rotary is None
    assert lm.decoder.layers[0].mlp.fc1.weight.shape == (64, 16)  # mlp_ratio 4.0


def test_check_names_each_problem():
    cfg = TransformerConfig(dim=100, num_heads=3, num_kv_heads=2, dropout=1.0, attn_dropout=-0.1,
                            drop_path_rate=1.5, activation="elu", norm="batchnorm", norm_eps=0.0, depth=0)
    assert cfg.check() == [
        "model.depth (0) must be >= 1",
        "model.dim (100) must be divisible by model.num_heads (3), or set model.head_dim",
        "model.num_heads (3) must be divisible by model.num_kv_heads (2)",
        "model.activation ('elu') must be one of gelu, gelu_tanh, relu, silu, swiglu, geglu, geglu_tanh",
        "model.norm ('batchnorm') must be one of layernorm, rmsnorm",
        "model.norm_eps (0.0) must be > 0",
        "model.dropout (1.0) must be in [0, 1)",
        "model.attn_dropout (-0.1) must be in [0, 1)",
        "model.drop_path_rate (1.5) must be in [0, 1)",
    ]
    assert TransformerConfig(dim=12, num_heads=4, pos_encoding="rotary").check("lm") == [
        "lm.pos_encoding 'rotary' needs an even head dim, got lm.dim / lm.num_heads = 3"
    ]
    with pytest.raises(ValueError, match=r"TransformerConfig: dim \(100\) must be divisible by num_heads \(3\)"):
        DecoderOnlyLM(TransformerConfig(dim=100, num_heads=3), 10)


def test_recipe_reading_rejects_unknown_keys_and_choices():
    errors: list[str] = []
    build_dataclass(TransformerConfig, {"dim": 32, "tie_output": False, "activation": "gelu2"}, "model", errors)
    assert any(e.startswith("model.tie_output: unknown key") and "tie_embeddings" in e for e in errors)
    assert any(e.startswith("model.activation: expected") and "gelu" in e for e in errors)


def test_vit_config_rules_and_subclass_keys():
    assert ViTConfig(dim=64, num_heads=4, pooling="mean", distilled=True, norm_first=False,
                     pos_encoding="rotary", encoder_depth=2).check() == [
        "model.distilled needs model.pooling 'cls' (the DeiT heads read the two tokens)",
        "model.norm_first must be true for the ViT (timm's blocks are pre-norm)",
        "model.pos_encoding ('rotary') must be 'learned' for the ViT",
        "model.encoder_depth is not used by the ViT; set model.depth instead",
    ]
    names = {f.name for f in dataclasses.fields(ViTConfig)}
    assert {f.name for f in dataclasses.fields(TransformerConfig)} < names
    assert {"patch_size", "pooling", "distilled"} <= names


def test_of_takes_the_shape_fields_of_a_plugin_section():
    @dataclasses.dataclass
    class PluginModel(TransformerConfig):  # a plugin's model: section with keys of its own
        pooling: str = "mean"
        head_dropout: float = 0.3

    section = PluginModel(**{k: v for k, v in LLAMA.items()}, pooling="max")
    cfg = TransformerConfig.of(section, max_len=77)
    assert type(cfg) is TransformerConfig and not hasattr(cfg, "pooling")
    assert cfg == TransformerConfig(**{**LLAMA, "max_len": 77})
