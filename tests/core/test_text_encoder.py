"""Tests for tk.core.nn.text_encoder: the position kinds (fixed sinusoidal table vs a learned
one) and the padding mask. Pooling and the BERT conversion are tested with the plugin
(tests/plugins/test_text_classification.py)."""

import math

import pytest
import torch

from tk.core.nn.config import TransformerConfig
from tk.core.nn.text_encoder import TextEncoder

D, T = 8, 5


def make_encoder(pos_encoding: str) -> TextEncoder:
    torch.manual_seed(0)
    cfg = TransformerConfig(dim=D, depth=1, num_heads=2, dropout=0.0, max_len=12, pos_encoding=pos_encoding)
    return TextEncoder(cfg, vocab_size=30)


def embedding_sum(enc: TextEncoder, ids: torch.Tensor) -> torch.Tensor:
    """The summed embeddings entering ``embed_norm``."""
    seen = []
    handle = enc.embed_norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    enc(ids)
    handle.remove()
    return seen[0]


def test_sinusoidal_positions_are_the_fixed_sin_cos_table():
    enc = make_encoder("sinusoidal")
    assert not [n for n, _ in enc.named_parameters() if "pos" in n]
    assert not [k for k in enc.state_dict() if k.startswith("pos_embed")]  # nothing to save or load
    expected = torch.zeros(T, D)
    for pos in range(T):
        for i in range(0, D, 2):
            angle = pos / 10000 ** (i / D)
            expected[pos, i], expected[pos, i + 1] = math.sin(angle), math.cos(angle)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    base = enc.tok_embed(ids) + enc.type_embed(torch.zeros_like(ids))
    torch.testing.assert_close(embedding_sum(enc, ids) - base, expected[None], atol=1e-6, rtol=0)


def test_learned_positions_are_a_trainable_table():
    enc = make_encoder("learned")
    assert [n for n, _ in enc.named_parameters() if "pos" in n] == ["pos_embed.weight"]  # the BERT converter's name
    assert enc.pos_embed.weight.shape == (12, D) and enc.pos_embed.weight.requires_grad
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    base = enc.tok_embed(ids) + enc.type_embed(torch.zeros_like(ids))
    torch.testing.assert_close(embedding_sum(enc, ids) - base, enc.pos_embed.weight[None, :T])
    enc(ids).sum().backward()
    assert enc.pos_embed.weight.grad[:T].abs().sum() > 0


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal", "rotary", "none"])
def test_padding_mask_comes_from_pad_id(pos_encoding):
    enc = make_encoder(pos_encoding).eval()
    ids = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 7]])
    mask = enc.padding_mask(ids)
    assert mask.tolist() == [[False, False, False, True, True], [False] * 5]
    torch.testing.assert_close(enc(ids), enc(ids, key_padding_mask=mask))
    torch.testing.assert_close(enc(ids)[:1, :3], enc(ids[:1, :3]), atol=1e-5, rtol=1e-5)  # PAD changes nothing
