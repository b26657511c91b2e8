"""Tests for tk.core.training.ema: the average vs hand computation, decay warmup, buffers, state."""

import pytest
import torch
from torch import nn

from tk.core.training.ema import ModelEMA


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def _set(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def test_constant_decay_by_hand():
    model = _model()
    _set(model, 1.0)
    ema = ModelEMA(model, decay=0.5)
    assert not ema.module.training and not any(p.requires_grad for p in ema.module.parameters())
    _set(model, 3.0)
    ema.update(model)  # 0.5 * 1 + 0.5 * 3
    _set(model, 5.0)
    ema.update(model)  # 0.5 * 2 + 0.5 * 5
    for p in ema.module.parameters():
        torch.testing.assert_close(p, torch.full_like(p, 3.5))
    assert ema.step == 2


def test_warmup_decay_and_buffers_copied():
    model = _model()
    _set(model, 0.0)
    ema = ModelEMA(model, decay=0.2, warmup_steps=10)
    assert ema.current_decay() == pytest.approx(0.1)  # min(0.2, 1/10)
    model.train()
    model(torch.randn(4, 3))  # changes BatchNorm running stats
    _set(model, 10.0)
    ema.update(model)  # d = 0.1: 0.1 * 0 + 0.9 * 10 = 9
    assert ema.current_decay() == pytest.approx(2 / 11)  # min(0.2, 2/11)
    ema.update(model)  # d = 2/11: (2 * 9 + 9 * 10) / 11
    torch.testing.assert_close(ema.module[0].weight, torch.full((2, 3), 108 / 11))
    for _ in range(10):
        ema.update(model)
    assert ema.current_decay() == 0.2  # warmup over: capped at decay
    torch.testing.assert_close(ema.module[1].running_mean, model[1].running_mean)
    assert ema.module[1].num_batches_tracked.item() == 1


def test_state_dict_round_trip_and_independence():
    model = _model()
    ema = ModelEMA(model, decay=0.9)
    _set(model, 2.0)
    ema.update(model)
    other = ModelEMA(_model(), decay=0.9)
    other.load_state_dict(ema.state_dict())
    assert other.step == 1
    for a, b in zip(ema.module.parameters(), other.module.parameters()):
        torch.testing.assert_close(a, b)
    _set(model, 100.0)  # the copy is independent of the live model
    assert ema.module[0].weight.max() < 100.0


def test_bad_decay():
    with pytest.raises(ValueError, match="decay"):
        ModelEMA(_model(), decay=1.0)


def test_non_persistent_caches_are_not_copied():
    """Rotary cos/sin tables grow with the longest sequence a module saw (non-persistent
    buffers): the EMA copy keeps its own and updating it after a forward pass works."""
    from tk.core.nn.config import TransformerConfig
    from tk.core.nn.transformer import DecoderOnlyLM

    torch.manual_seed(0)
    model = DecoderOnlyLM(TransformerConfig(dim=16, depth=1, num_heads=2, pos_encoding="rotary", dropout=0.0), 11)
    ema = ModelEMA(model, decay=0.5)
    tokens = torch.randint(0, 11, (2, 7))
    model(tokens)  # grows the model's rotary tables to 7 positions; the copy's are still empty
    ema.update(model)  # raised a shape mismatch when every buffer was copied
    assert torch.allclose(ema.module(tokens), model(tokens))  # equal weights (the model did not change)
