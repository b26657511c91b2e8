"""Tests for tk.core.schedule: multipliers vs their formulas, the step convention, resume."""

import math

import pytest
import torch
from torch import nn

from tk.core.optim import OptimConfig, build_optimizer
from tk.core.schedule import ScheduleConfig, build_scheduler, lr_multiplier


def test_noam_matches_formula():
    cfg = ScheduleConfig(name="inverse_sqrt", warmup_steps=4000, noam_d_model=512)
    for step in (1, 4000, 8000):
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert lr_multiplier(step, 100_000, cfg) == pytest.approx(expected, rel=1e-12)
    # the peak is at the end of warmup
    assert lr_multiplier(4000, 0, cfg) > lr_multiplier(3999, 0, cfg)
    assert lr_multiplier(4000, 0, cfg) > lr_multiplier(4001, 0, cfg)


def test_warmup_cosine_peak_and_floor():
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(1, 110, cfg) == pytest.approx(0.1)  # first update: 1/W of peak
    assert lr_multiplier(10, 110, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, 110, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way
    assert lr_multiplier(110, 110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(500, 110, cfg) == pytest.approx(0.1)  # stays at the floor


def test_inverse_sqrt_without_d_model():
    cfg = ScheduleConfig(name="inverse_sqrt", warmup_steps=100)
    assert lr_multiplier(50, 0, cfg) == pytest.approx(0.5)
    for step in (100, 400, 2500):
        assert lr_multiplier(step, 0, cfg) == pytest.approx(math.sqrt(100 / step))


def test_linear_decays_to_floor_and_warmup_init_ratio():
    cfg = ScheduleConfig(name="linear", warmup_steps=4, min_lr_ratio=0.2, warmup_init_ratio=0.2)
    assert lr_multiplier(2, 14, cfg) == pytest.approx(0.2 + 0.8 * 2 / 4)
    assert lr_multiplier(4, 14, cfg) == pytest.approx(1.0)
    assert lr_multiplier(9, 14, cfg) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr_multiplier(14, 14, cfg) == pytest.approx(0.2)


def test_constant_and_warmup_longer_than_run():
    assert lr_multiplier(1, 5, ScheduleConfig()) == 1.0
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=10)
    assert lr_multiplier(2, 2, cfg) == pytest.approx(0.2)  # a 2-step smoke run: no crash


def test_scheduler_first_update_uses_step_1_and_respects_lr_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = build_optimizer(model, OptimConfig(lr=1.0, layer_decay=0.5), layer_id_fn=lambda n: int(n[0]) + 1, num_layers=2)
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=4)
    sched = build_scheduler(opt, cfg, total_steps=20)
    seen = []
    for step in range(1, 21):
        seen.append([g["lr"] for g in opt.param_groups])  # lr used by update `step`
        opt.step()
        sched.step()
    for step, lrs in enumerate(seen, start=1):
        m = lr_multiplier(step, 20, cfg)
        assert sorted(lrs) == pytest.approx(sorted([0.5 * m, 0.5 * m, 1.0 * m, 1.0 * m]))
    assert max(range(20), key=lambda i: seen[i][0]) == 3  # peak on update 4 == warmup_steps


def test_scheduler_state_dict_resume():
    torch.manual_seed(0)
    cfg = ScheduleConfig(name="linear", warmup_steps=3)

    def make():
        model = nn.Linear(2, 2)
        opt = build_optimizer(model, OptimConfig(lr=0.1))
        return opt, build_scheduler(opt, cfg, total_steps=10)

    opt, sched = make()
    for _ in range(5):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for _ in range(3):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert [g["lr"] for g in opt2.param_groups] == pytest.approx([g["lr"] for g in opt.param_groups])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_multiplier(9, 10, cfg))


@pytest.mark.parametrize(
    "kwargs, key",
    [({"warmup_steps": -1}, "schedule.warmup_steps"), ({"min_lr_ratio": 2.0}, "schedule.min_lr_ratio"),
     ({"name": "inverse_sqrt", "noam_d_model": 512}, "schedule.noam_d_model needs schedule.warmup_steps"),
     ({"name": "cosine"}, "schedule.name")],
)
def test_validation(kwargs, key):
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_scheduler(opt, ScheduleConfig(**kwargs), total_steps=10)
