"""Tests for tk.core.nn.transformer: stacks and the seq2seq model match nn.Transformer with
copied weights; no leakage; KV-cached decoding equals full recomputation (with reorder)."""

import math
import warnings

import pytest
import torch
from torch import nn

from tests.core.test_blocks import _randomise_norms, copy_decoder_layer, copy_encoder_layer, copy_linear_norm
from tk.core.nn.config import TransformerConfig
from tk.core.nn.masks import causal_mask
from tk.core.nn.pos_embed import sinusoidal_table
from tk.core.nn.transformer import DecoderOnlyLM, EncoderDecoder, TransformerDecoder, TransformerEncoder
from tk.core.optim import OptimConfig, build_optimizer

D, H, FF = 16, 4, 32


def seq2seq_cfg(**kw) -> TransformerConfig:
    """The paper's model (post-norm, ReLU, sinusoidal, tied output) at toy size, no dropout."""
    args = dict(dim=D, depth=2, num_heads=H, hidden_dim=FF, dropout=0.0, activation="relu", norm_first=False,
                pos_encoding="sinusoidal")
    return TransformerConfig(**{**args, **kw})


def lm_cfg(**kw) -> TransformerConfig:
    """A GPT-style model (pre-norm, GELU, learned positions, tied output) at toy size."""
    args = dict(dim=D, depth=2, num_heads=H, dropout=0.0, activation="gelu", norm_first=True,
                pos_encoding="learned")
    return TransformerConfig(**{**args, **kw})


def make_torch_transformer(norm_first: bool) -> nn.Transformer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor notice for norm_first
        ref = nn.Transformer(D, H, 2, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    _randomise_norms(ref)
    return ref.eval()


@torch.no_grad()
def copy_transformer(encoder: TransformerEncoder, decoder: TransformerDecoder, ref: nn.Transformer) -> None:
    for ours, theirs in zip(encoder.layers, ref.encoder.layers):
        copy_encoder_layer(ours, theirs)
    for ours, theirs in zip(decoder.layers, ref.decoder.layers):
        copy_decoder_layer(ours, theirs)
    copy_linear_norm(encoder.norm, ref.encoder.norm)
    copy_linear_norm(decoder.norm, ref.decoder.norm)


def _masks():
    src_kpm = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    tgt_kpm = torch.tensor([[False] * 3 + [True] * 2, [False] * 5])
    return src_kpm, tgt_kpm


@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_nn_transformer(norm_first):
    torch.manual_seed(0)
    ref = make_torch_transformer(norm_first)
    options = seq2seq_cfg(norm_first=norm_first, final_norm=True)
    enc, dec = TransformerEncoder(options).eval(), TransformerDecoder(options).eval()
    copy_transformer(enc, dec, ref)
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    src_kpm, tgt_kpm = _masks()
    expected = ref(
        src, tgt, tgt_mask=causal_mask(5), src_key_padding_mask=src_kpm, tgt_key_padding_mask=tgt_kpm,
        memory_key_padding_mask=src_kpm, tgt_is_causal=True,
    )
    memory = enc(src, key_padding_mask=src_kpm)
    out = dec(tgt, memory, key_padding_mask=tgt_kpm, memory_key_padding_mask=src_kpm)
    assert torch.allclose(out, expected, atol=1e-5)


def small_seq2seq(**kw) -> EncoderDecoder:
    return EncoderDecoder(seq2seq_cfg(**kw), 11, 13, pad_id=0).eval()


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_decoder_matches_nn_transformer(norm_first):
    torch.manual_seed(1)
    ref = make_torch_transformer(norm_first)
    model = small_seq2seq(norm_first=norm_first, final_norm=True)
    copy_transformer(model.encoder, model.decoder, ref)
    src = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 0, 0, 0]])
    tgt = torch.tensor([[1, 2, 3, 0, 0], [1, 5, 6, 7, 8]])
    src_kpm, tgt_kpm = src.eq(0), tgt.eq(0)
    # The paper's input: embedding * sqrt(D) + sinusoidal encoding, written out by hand.
    src_x = model.src_embed.weight[src] * math.sqrt(D) + sinusoidal_table(7, D)
    tgt_x = model.tgt_embed.weight[tgt] * math.sqrt(D) + sinusoidal_table(5, D)
    hidden = ref(
        src_x, tgt_x, tgt_mask=causal_mask(5), src_key_padding_mask=src_kpm, tgt_key_padding_mask=tgt_kpm,
        memory_key_padding_mask=src_kpm, tgt_is_causal=True,
    )
    expected = hidden @ model.tgt_embed.weight.T  # tied output projection
    assert torch.allclose(model(src, tgt, tgt_key_padding_mask=tgt_kpm), expected, atol=1e-5)
    # Without a target mask (the default, fast path) only PAD target positions may differ.
    assert torch.allclose(model(src, tgt)[~tgt_kpm], expected[~tgt_kpm], atol=1e-5)


def test_source_padding_mask_derived_from_pad_id():
    torch.manual_seed(7)
    model = small_seq2seq()
    src, tgt = torch.tensor([[3, 4, 5, 0, 0]]), torch.tensor([[1, 6, 7]])
    assert torch.allclose(model(src, tgt), model(src, tgt, src_key_padding_mask=src.eq(0)), atol=1e-6)
    unmasked = model(src, tgt, src_key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    assert not torch.allclose(model(src, tgt), unmasked)


def test_tying_and_sharing():
    m = small_seq2seq()
    assert m.lm_head.weight is m.tgt_embed.weight and m.src_embed is not m.tgt_embed
    shared = EncoderDecoder(seq2seq_cfg(depth=1, share_embeddings=True), 13, 13)
    assert shared.src_embed is shared.tgt_embed is not None and shared.lm_head.weight is shared.src_embed.weight
    untied = small_seq2seq(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tgt_embed.weight
    with pytest.raises(ValueError, match=r"src_vocab_size \(11\) and tgt_vocab_size \(13\)"):
        EncoderDecoder(seq2seq_cfg(share_embeddings=True), 11, 13)
    lm = DecoderOnlyLM(lm_cfg(depth=1), 17)
    assert lm.lm_head.weight is lm.tok_embed.weight
    untied_lm = DecoderOnlyLM(lm_cfg(depth=1, tie_embeddings=False), 17)
    assert untied_lm.lm_head.weight is not untied_lm.tok_embed.weight


def test_seq2seq_no_leakage():
    torch.manual_seed(2)
    model = small_seq2seq()
    src = torch.tensor([[3, 4, 5, 0, 0]])
    tgt = torch.tensor([[1, 6, 7, 8, 9, 10]])
    base = model(src, tgt)
    for t in range(5):
        tgt2 = tgt.clone()
        tgt2[0, t + 1] = 12
        assert torch.allclose(model(src, tgt2)[:, : t + 1], base[:, : t + 1], atol=1e-5)
    # Changing PAD source tokens (with the mask given explicitly) leaves everything unchanged.
    src2 = torch.tensor([[3, 4, 5, 9, 10]])
    assert torch.allclose(model(src2, tgt, src_key_padding_mask=src.eq(0)), base, atol=1e-5)


def test_lm_no_leakage_and_padding():
    torch.manual_seed(3)
    lm = DecoderOnlyLM(lm_cfg(), 17).eval()
    tokens = torch.randint(1, 17, (1, 8))
    base = lm(tokens)
    for t in range(7):
        tok2 = tokens.clone()
        tok2[0, t + 1] = (tok2[0, t + 1] % 16) + 1
        assert torch.allclose(lm(tok2)[:, : t + 1], base[:, : t + 1], atol=1e-5)
    kpm = torch.zeros(1, 8, dtype=torch.bool)
    kpm[0, :3] = True  # left padding
    out = lm(tokens, key_padding_mask=kpm)
    tok3 = tokens.clone()
    tok3[0, :3] = 5
    out3 = lm(tok3, key_padding_mask=kpm)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, 3:], out3[:, 3:], atol=1e-5)


def test_too_long_sequence_raises():
    lm = DecoderOnlyLM(lm_cfg(depth=1, max_len=8), 17)
    with pytest.raises(ValueError, match=r"sequence length \(9\) exceeds max_len \(8\)"):
        lm(torch.ones(1, 9, dtype=torch.long))
    extrapolating = DecoderOnlyLM(lm_cfg(depth=1, max_len=8, pos_encoding="sinusoidal"), 17)
    assert extrapolating(torch.ones(1, 9, dtype=torch.long)).shape == (1, 9, 17)
    with pytest.raises(ValueError, match="pos_encoding"):
        DecoderOnlyLM(lm_cfg(depth=1, pos_encoding="alibi"), 17)


@pytest.mark.parametrize(
    "kw", [dict(), dict(pos_encoding="sinusoidal", norm_first=False), dict(pos_encoding="rotary", num_kv_heads=1)]
)
def test_lm_cached_decoding_matches_full_with_reorder(kw):
    torch.manual_seed(4)
    lm = DecoderOnlyLM(lm_cfg(max_len=32, **kw), 17).eval()
    tokens = torch.randint(1, 17, (3, 9))
    idx = torch.tensor([1, 1, 0])
    with torch.no_grad():
        cache = lm.init_cache(3, max_len=4)  # small: exercises buffer growth
        steps = [lm.decode_step(tokens[:, :3], cache)]  # prefill
        steps += [lm.decode_step(tokens[:, t : t + 1], cache) for t in range(3, 6)]
        assert torch.allclose(torch.cat(steps, 1), lm(tokens[:, :6]), atol=1e-5)
        lm.reorder_cache(cache, idx)
        hist = torch.cat([tokens[idx, :6], tokens[:, 6:]], dim=1)  # reordered history + new tokens
        after = [lm.decode_step(hist[:, t : t + 1], cache) for t in range(6, 9)]
        assert torch.allclose(torch.cat(after, 1), lm(hist)[:, 6:], atol=1e-5)
    with pytest.raises(ValueError, match="batch size 2 but the cache holds 3"):
        lm.decode_step(tokens[:2, :1], cache)


@pytest.mark.parametrize("kw", [dict(), dict(norm_first=True, pos_encoding="learned", num_kv_heads=2)])
def test_seq2seq_cached_decoding_matches_full_with_reorder(kw):
    torch.manual_seed(5)
    model = small_seq2seq(**kw)
    src = torch.tensor([[3, 4, 5, 6, 7], [3, 4, 0, 0, 0], [8, 9, 10, 0, 0]])
    tgt = torch.randint(1, 13, (3, 7))
    mem_kpm = model.src_key_padding_mask(src)
    idx = torch.tensor([2, 0, 0])
    with torch.no_grad():
        memory = model.encode(src)
        cache = model.init_cache(3, max_len=8)
        steps = [model.decode_step(tgt[:, t : t + 1], memory, mem_kpm, cache) for t in range(4)]
        assert torch.allclose(torch.cat(steps, 1), model(src, tgt[:, :4]), atol=1e-5)
        model.reorder_cache(cache, idx)
        hist = torch.cat([tgt[idx, :4], tgt[:, 4:]], dim=1)
        # memory is no longer needed: the cross-attention k/v are cached (and reordered)
        after = [model.decode_step(hist[:, t : t + 1], None, mem_kpm[idx], cache) for t in range(4, 7)]
        assert torch.allclose(torch.cat(after, 1), model(src[idx], hist)[:, 4:], atol=1e-5)


def test_seq2seq_backward_finite():
    torch.manual_seed(6)
    model = small_seq2seq(dropout=0.1, drop_path_rate=0.1).train()
    src = torch.tensor([[3, 4, 5, 0], [0, 0, 0, 0]])  # second source is all padding
    logits = model(src, torch.tensor([[1, 2, 3], [1, 4, 0]]))
    logits.logsumexp(-1).sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_layer_ids_for_layer_decay():
    lm = DecoderOnlyLM(lm_cfg(depth=3), 17)
    assert lm.num_layers() == 4
    opt = build_optimizer(lm, OptimConfig(lr=1.0, layer_decay=0.5))
    lr = {name: g["lr"] for g in opt.param_groups for name in g["param_names"]}
    assert lr["tok_embed.weight"] == lr["pos.weight"] == 0.5**4  # embeddings: id 0
    for i in range(3):  # layer i: id i + 1
        assert lr[f"decoder.layers.{i}.self_attn.qkv.weight"] == 0.5 ** (4 - (i + 1))
    assert lr["decoder.norm.weight"] == 1.0  # final norm (and the tied head): id 4
    seq2seq = small_seq2seq(encoder_depth=2, decoder_depth=3, norm_first=True, tie_embeddings=False)
    ids = {name: seq2seq.layer_id(name) for name, _ in seq2seq.named_parameters()}
    assert seq2seq.num_layers() == 6
    assert ids["src_embed.weight"] == ids["tgt_embed.weight"] == 0
    assert ids["encoder.layers.1.mlp.fc1.weight"] == 2 and ids["encoder.norm.weight"] == 3
    assert ids["decoder.layers.0.cross_attn.q_proj.weight"] == 3 and ids["decoder.layers.2.norm3.bias"] == 5
    assert ids["decoder.norm.weight"] == ids["lm_head.weight"] == 6
