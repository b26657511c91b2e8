"""Tests for tk.core.nn.masks: the bool True = masked convention and its helpers."""

import pytest
import torch

from tk.core.nn.masks import causal_mask, from_additive, merge_masks, padding_mask, to_additive


def test_padding_mask_marks_pad_tokens():
    tokens = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    expected = torch.tensor([[False, False, True, True], [False, True, True, True]])
    assert torch.equal(padding_mask(tokens, pad_id=0), expected)


def test_padding_mask_rejects_1d():
    with pytest.raises(ValueError, match=r"shape \(B, T\), got shape \(4,\)"):
        padding_mask(torch.tensor([1, 2, 0, 0]), 0)


def test_causal_mask_square():
    expected = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    assert torch.equal(causal_mask(3), expected)
    assert causal_mask(3).dtype == torch.bool


def test_causal_mask_bottom_right_with_more_keys():
    # 2 new queries at absolute positions 3 and 4 of a 5-key sequence
    m = causal_mask(2, num_keys=5)
    expected = torch.tensor([[False, False, False, False, True], [False] * 5])
    assert torch.equal(m, expected)
    with pytest.raises(ValueError, match="num_keys=2"):
        causal_mask(3, num_keys=2)


def test_merge_masks_shapes_and_values():
    torch.manual_seed(0)
    B, Tq, Tk = 2, 3, 4
    attn = torch.rand(Tq, Tk) > 0.5
    kpm = torch.tensor([[False, False, True, True], [False, False, False, True]])
    merged = merge_masks(attn, kpm)
    assert merged.shape == (B, 1, Tq, Tk)
    assert torch.equal(merged, attn[None, None] | kpm[:, None, None, :])
    assert merge_masks(None, kpm).shape == (B, 1, 1, Tk)
    assert merge_masks(torch.zeros(B, Tq, Tk, dtype=torch.bool)).shape == (B, 1, Tq, Tk)
    assert merge_masks(torch.zeros(B, 5, Tq, Tk, dtype=torch.bool)).shape == (B, 5, Tq, Tk)
    assert merge_masks(None, None) is None


def test_merge_masks_errors_name_shapes():
    with pytest.raises(ValueError, match="bool tensor.*got dtype torch.float32"):
        merge_masks(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        merge_masks(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Tk\), got shape \(2, 1, 4\)"):
        merge_masks(None, torch.zeros(2, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="Tk=4.*expected Tk=5"):
        merge_masks(None, torch.zeros(2, 4, dtype=torch.bool), tk=5)
    with pytest.raises(ValueError, match="do not broadcast"):
        merge_masks(torch.zeros(3, 3, 4, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.bool))


def test_additive_roundtrip_uses_finfo_min():
    mask = torch.tensor([[False, True], [True, True]])
    add = to_additive(mask, torch.float16)
    assert add.dtype == torch.float16
    assert add[0, 0] == 0 and add[0, 1] == torch.finfo(torch.float16).min
    assert not torch.isinf(add).any()
    assert torch.equal(from_additive(add), mask)
    assert torch.equal(from_additive(torch.tensor([[0.0, float("-inf")]])), torch.tensor([[False, True]]))
    assert to_additive(None) is None and from_additive(None) is None


def test_additive_errors():
    with pytest.raises(ValueError, match="attention bias"):
        from_additive(torch.tensor([0.0, -1.5]))
    with pytest.raises(ValueError, match="float mask"):
        from_additive(torch.tensor([True]))
    with pytest.raises(ValueError, match="floating dtype"):
        to_additive(torch.tensor([True]), torch.int32)
