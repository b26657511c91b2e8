"""Tests for tk.core.optim: weight-decay groups, frozen params, layer-wise lr decay."""

import copy

import pytest
import torch
from torch import nn

from tk.core.optim import OptimConfig, build_optimizer, param_groups


class Toy(nn.Module):
    """Embedding -> 2 blocks (Linear + LayerNorm) -> head, plus a cls token."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))  # 3-D: decayed unless listed
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2))
        self.head = nn.Linear(8, 10)
        if tie:
            self.head.weight = self.embed.weight

    def no_weight_decay(self):
        return {"pos_embed"}

    def layer_id(self, name: str) -> int:
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        if name.startswith("head."):
            return 3
        return 0

    def num_layers(self) -> int:
        return 3


def _decay_of(opt):
    return {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}


def test_no_decay_on_norms_biases_embeddings_and_listed_names():
    torch.manual_seed(0)
    opt = build_optimizer(Toy(), OptimConfig(weight_decay=0.1))
    wd = _decay_of(opt)
    assert wd["embed.weight"] == 0.0
    assert wd["pos_embed"] == 0.0  # from no_weight_decay()
    assert wd["cls_token"] == 0.1  # 3-D and not listed
    assert wd["blocks.0.0.weight"] == 0.1 and wd["head.weight"] == 0.1
    assert wd["blocks.0.0.bias"] == 0.0 and wd["blocks.1.1.weight"] == 0.0  # bias, LayerNorm
    assert isinstance(opt, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(Toy().parameters()))


def test_decay_embeddings_decays_the_tables_but_not_norms_biases_or_listed_names():
    wd = _decay_of(build_optimizer(Toy(), OptimConfig(weight_decay=0.1, decay_embeddings=True)))
    assert wd["embed.weight"] == 0.1  # nanoGPT's rule: every 2-D tensor
    assert wd["blocks.0.0.bias"] == wd["blocks.1.1.weight"] == wd["pos_embed"] == 0.0


def test_decay_norm_and_bias_puts_everything_in_decay():
    opt = build_optimizer(Toy(), OptimConfig(weight_decay=0.1, decay_norm_and_bias=True))
    assert set(_decay_of(opt).values()) == {0.1}


def test_frozen_params_excluded_and_tied_counted_once():
    torch.manual_seed(0)
    model = Toy(tie=True)
    model.blocks[0].requires_grad_(False)
    opt = build_optimizer(model, OptimConfig(name="sgd", lr=0.1, momentum=0.5, nesterov=True))
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert not any(n.startswith("blocks.0.") for n in names)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    # the tied head/embedding weight is an embedding weight: no decay
    assert id(model.embed.weight) in {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["nesterov"]


def test_layer_decay_scales():
    cfg = OptimConfig(lr=1.0, layer_decay=0.5)
    opt = build_optimizer(Toy(), cfg)
    scale = {n: g["lr_scale"] for g in opt.param_groups for n in g["param_names"]}
    assert scale["head.weight"] == 1.0
    assert scale["blocks.1.0.weight"] == 0.5
    assert scale["blocks.0.0.weight"] == 0.25
    assert scale["embed.weight"] == 0.125
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(cfg.lr * g["lr_scale"])


def test_layer_decay_with_function_argument_and_missing_hook():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="layer_id"):
        build_optimizer(model, OptimConfig(layer_decay=0.5))
    opt = build_optimizer(model, OptimConfig(lr=2.0, layer_decay=0.5), layer_id_fn=lambda n: int(n[0]) + 1, num_layers=2)
    lrs = {n: g["lr"] for g in opt.param_groups for n in g["param_names"]}
    assert lrs["0.weight"] == 1.0 and lrs["1.weight"] == 2.0


@pytest.mark.parametrize(
    "kwargs, key",
    [({"lr": -1.0}, "optim.lr must be > 0, got -1.0"), ({"betas": [0.9, 1.0]}, "optim.betas"),
     ({"layer_decay": 0.0}, "optim.layer_decay"), ({"eps": 0.0}, "optim.eps")],
)
def test_validation_names_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_optimizer(Toy(), OptimConfig(**kwargs))


def test_adamw_step_matches_manual_param_groups():
    """Same update as torch.optim.AdamW built by hand with the expected groups."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer(a, OptimConfig(lr=0.1, weight_decay=0.5))
    opt_b = torch.optim.AdamW([{"params": [b.weight], "weight_decay": 0.5}, {"params": [b.bias], "weight_decay": 0.0}], lr=0.1)
    x = torch.randn(5, 3)
    for model, opt in ((a, opt_a), (b, opt_b)):
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(a.weight, b.weight)
    torch.testing.assert_close(a.bias, b.bias)


def test_no_trainable_params():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        param_groups(model, OptimConfig())


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_and_foreach_kernels_match_the_plain_loop(name):
    """optim.fused / optim.foreach reach torch's optimiser and change nothing but speed:
    3 steps give the same parameters (1e-6) as the single-tensor loop."""
    results = {}
    for kernel in ({"fused": True}, {"foreach": True}, {"foreach": False}):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        opt = build_optimizer(model, OptimConfig(name=name, lr=0.1, weight_decay=0.1, **kernel))
        assert all(opt.defaults[k] is v for k, v in kernel.items())
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        results[str(kernel)] = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = results[str({"foreach": False})]
    for got in results.values():
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_fused_and_foreach_together_are_refused():
    assert OptimConfig(fused=True, foreach=True).check() == [
        "optim.fused and optim.foreach: choose one of them (set the other to null)"]


def _quadratic_steps(opt, p, targets):
    """A step per target on loss = sum((p - target)**2 / 2) (gradient p - target)."""
    for t in targets:
        opt.zero_grad()
        ((p - t) ** 2 / 2).sum().backward()
        opt.step()


def test_lion_takes_the_sign_steps_of_its_paper():
    """optim.name=lion: c = b1*m + (1-b1)*g, p -= lr*(sign(c) + wd*p), m = b2*m + (1-b2)*g
    (Chen et al. 2023, Algorithm 2), checked by hand over two steps; biases get no decay."""
    lr, wd, (b1, b2) = 0.1, 0.5, (0.9, 0.99)
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(0.3)
    opt = build_optimizer(model, OptimConfig(name="lion", lr=lr, weight_decay=wd, betas=[b1, b2]))
    x1, x2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    w, b, m_w, m_b = model.weight.detach().clone(), model.bias.detach().clone(), 0.0, 0.0
    for x in (x1, x2):
        opt.zero_grad()
        model(x).sum().backward()  # d/dw = x, d/db = 1
        g_w, g_b = x, torch.ones(1)
        c_w, c_b = b1 * m_w + (1 - b1) * g_w, b1 * m_b + (1 - b1) * g_b
        w = w * (1 - lr * wd) - lr * torch.sign(c_w)
        b = b - lr * torch.sign(c_b)  # no decay on biases
        m_w, m_b = b2 * m_w + (1 - b2) * g_w, b2 * m_b + (1 - b2) * g_b
        opt.step()
    torch.testing.assert_close(model.weight.detach(), w)
    torch.testing.assert_close(model.bias.detach(), b)


def test_adafactor_is_torchs_with_factored_state_and_tks_groups():
    """optim.name=adafactor is torch.optim.Adafactor over tk's groups (decay on matrices only): the same
    parameters as a hand-built one after 3 steps, and a matrix's second moment is a row and a column
    vector, not a matrix (the memory it saves)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    b, before = copy.deepcopy(a), copy.deepcopy(a)
    opt_a = build_optimizer(a, OptimConfig(name="adafactor", lr=0.05, weight_decay=0.1))
    decay = [p for n, p in b.named_parameters() if p.ndim == 2]
    rest = [p for n, p in b.named_parameters() if p.ndim < 2]
    opt_b = torch.optim.Adafactor([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=0.05)
    for model, opt in ((a, opt_a), (b, opt_b)):
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    state = opt_a.state[a[0].weight]
    assert state["row_var"].numel() + state["col_var"].numel() == 8 + 6
    assert not any(torch.equal(pa, p0) for pa, p0 in zip(a.parameters(), before.parameters()))  # it moved


@pytest.mark.parametrize("name", ["adafactor", "lion"])
def test_adafactor_and_lion_learn_and_their_foreach_kernel_changes_nothing(name):
    """Both minimise a quadratic; foreach=True gives the plain loop's parameters (1e-6). (Not from zeros:
    Adafactor's step is relative to the parameter's RMS.)"""
    target = torch.linspace(-1, 1, 12).reshape(3, 4)
    start = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    results = {}
    for foreach in (True, False):
        p = nn.Parameter(start.clone())
        holder = nn.Module()
        holder.p = p
        opt = build_optimizer(holder, OptimConfig(name=name, lr=0.05, weight_decay=0.0, foreach=foreach,
                                                  betas=[0.9, 0.99]))
        _quadratic_steps(opt, p, [target] * 200)
        results[foreach] = p.detach().clone()
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=1e-6)
    assert (results[False] - target).abs().max() < 0.1 * (start - target).abs().max()


@pytest.mark.parametrize("name", ["adafactor", "lion"])
def test_fused_is_refused_for_optimisers_without_a_fused_kernel(name):
    assert OptimConfig(name=name, fused=True).check() == [
        f"optim.fused: {name} has no fused kernel; set optim.fused=null (optim.foreach=true is its multi-tensor kernel)"]
