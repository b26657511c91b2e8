"""The training engine in one process: exact gradient accumulation, precision and loss
scaling, non-finite steps, EMA, overfit mode, early stopping, grad checkpointing and
crash-safe checkpoints (toy tasks from conftest, a few seconds each)."""

import copy
import json
import re
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tk.core.engine.train import Trainer
from tk.core.errors import TkError
from tk.core.recipe import load_config
from tk.core.run.checkpoint import load_checkpoint
from tk.core.training.precision import LossScaling


@pytest.fixture(autouse=True)
def _no_global_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def make_trainer(tmp_path, task="toy_tokens", overrides=(), run_dir=None) -> Trainer:
    recipe = tmp_path / f"{task}.yaml"
    recipe.write_text(f"task: {task}\noptim: {{lr: 0.01}}\ntrain: {{progress: false, log_every: 1}}\n")
    cfg, task_cls = load_config(recipe, list(overrides))
    return Trainer(cfg, task_cls, run_dir)


def grads_before_each_step(trainer: Trainer) -> list[list[torch.Tensor]]:
    grads: list[list[torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.append([p.grad.clone() for p in trainer.model.parameters()]))
    return grads


def test_accumulation_equals_one_big_batch_for_a_token_level_loss(toy_site, tmp_path):
    common = ["data.min_len=1", "data.max_len=12", "optim.weight_decay=0.1", "train.max_steps=6",
              "train.eval_every=1000", "train.seed=3"]
    accum = make_trainer(tmp_path, overrides=common + ["train.batch_size=8", "train.grad_accum=4"])
    big = make_trainer(tmp_path, overrides=common + ["train.batch_size=32", "train.grad_accum=1"])
    for a, b in zip(accum.model.parameters(), big.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same seed, same init
    g_accum, g_big = grads_before_each_step(accum), grads_before_each_step(big)
    stats_accum = [accum.train_step() for _ in range(6)]
    stats_big = [big.train_step() for _ in range(6)]
    for step, (ga, gb) in enumerate(zip(g_accum, g_big)):
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=f"gradient of update {step + 1}")
    for x, y in zip(accum.model.parameters(), big.model.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert [s["items"] for s in stats_accum] == [s["items"] for s in stats_big]  # same tokens per update
    for sa, sb in zip(stats_accum, stats_big):
        assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-6)


def test_accumulation_test_would_catch_per_micro_batch_averaging(toy_site, tmp_path):
    """The micro-batches really differ in token count, so averaging each one's loss
    (the common bug) gives another gradient than the engine's global normalisation."""
    t = make_trainer(tmp_path, overrides=["train.batch_size=8", "train.grad_accum=4", "train.max_steps=1"])
    model = copy.deepcopy(t.model)
    t.train_loader.sampler.set_epoch(0)
    batches = [b for _, b in zip(range(4), t.train_loader)]
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    assert len(set(counts)) > 1
    naive = sum(t.task.loss(model, b).loss / n for b, n in zip(batches, counts)) / 4
    naive_grad = torch.autograd.grad(naive, list(model.parameters()))
    exact = sum(t.task.loss(model, b).loss for b in batches) / sum(counts)
    exact_grad = torch.autograd.grad(exact, list(model.parameters()))
    engine = grads_before_each_step(t)
    t.train_step()
    for e, x in zip(engine[0], exact_grad):
        torch.testing.assert_close(e, x, rtol=0, atol=1e-6)
    assert max((a - b).abs().max() for a, b in zip(naive_grad, exact_grad)) > 1e-3


def test_bf16_autocast_on_cpu_trains(toy_site, tmp_path):
    t = make_trainer(tmp_path, "toy", ["train.precision=bf16", "train.max_steps=30", "train.batch_size=32"])
    losses = [t.train_step()["loss"] for _ in range(30)]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_loss_scaling_skips_an_injected_inf_gradient_and_counts_it(toy_site, tmp_path):
    t = make_trainer(tmp_path, "toy", ["train.max_steps=4"])
    # the fp16 GradScaler logic, run on CPU (Precision refuses fp16 off CUDA)
    t.precision.scaling = LossScaling(torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100))
    weight = t.model[0].weight
    inject = {"on": False}
    weight.register_hook(lambda g: g * float("inf") if inject["on"] else g)
    assert t.train_step()["skipped"] == 0.0
    before = weight.detach().clone()
    inject["on"] = True
    stats = t.train_step()
    inject["on"] = False
    assert stats["skipped"] == 1.0 and not torch.isfinite(torch.tensor(stats["grad_norm"]))
    torch.testing.assert_close(weight, before, rtol=0, atol=0)  # the update was not applied
    assert t.precision.scaling.get_scale() == 512.0  # halved after the overflow
    assert t.progress["skipped_steps"] == 1 and t.progress["bad_steps"] == 0  # a scaler skip is no failure
    assert t.train_step()["skipped"] == 0.0
    assert not torch.equal(weight, before)


class CountOps(TorchDispatchMode):
    """Counts the tensor ops (aten) dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_an_update_costs_three_tensor_ops_more_than_a_bare_step(toy_site, tmp_path):
    """The engine's per-update work (non-finite check, grad norm, loss to log) is the
    per-tensor norms, one stack for the one host sync and a detach; no scale/clip pass
    when the loss was normalised in the forward and nothing needs clipping."""
    t = make_trainer(tmp_path, "toy", ["train.max_steps=10", "train.clip_grad_norm=1e9"])
    t.train_step()  # the first update sets up optimizer state and measures activations
    t.model.eval()  # a caller's eval() is undone by the next update
    with CountOps() as engine:
        t.train_step()
    assert all(m.training for m in t.model.modules())
    with CountOps() as bare:
        out = t.task.loss(t.model, t.batches.next())
        (out.loss / out.num_items).backward()
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.scheduler.step()
    assert engine.ops - bare.ops == Counter({"detach": 1, "_foreach_norm": 1, "stack": 1})
    assert not bare.ops - engine.ops


def test_non_finite_steps_are_skipped_named_and_stop_the_run(toy_site, tmp_path, capsys):
    t = make_trainer(tmp_path, "toy", ["optim.lr=1e30", "optim.name=sgd", "optim.momentum=0.0",
                                       "train.max_steps=20", "train.max_bad_steps=3"])
    with pytest.raises(RuntimeError, match=r"3 non-finite steps in a row .*first non-finite gradient in "
                                           r"'\d\.(weight|bias)'.*optim\.lr"):
        t.fit()
    out = capsys.readouterr().out
    assert re.search(r"non-finite loss .* update skipped; first non-finite gradient in '\d\.(weight|bias)'", out)


def test_ema_weights_follow_the_formula_and_are_evaluated(toy_site, tmp_path):
    t = make_trainer(tmp_path, "toy", ["train.ema_decay=0.9", "train.ema_warmup_steps=3", "train.max_steps=5",
                                       "train.eval_every=5"])
    ema = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    updates = []
    t.optimizer.register_step_post_hook(lambda *_: updates.append(
        {n: p.detach().clone() for n, p in t.model.named_parameters()}))
    results = t.fit()
    for n_update, weights in enumerate(updates):
        d = min(0.9, (1 + n_update) / (3 + n_update))
        ema = {k: d * ema[k] + (1 - d) * weights[k] for k in ema}
    for name, p in t.ema.module.named_parameters():
        torch.testing.assert_close(p, ema[name], rtol=0, atol=1e-6)
    assert {"val/loss", "val/top1", "val_ema/loss", "val_ema/top1"} <= set(results)
    assert results["val_ema/loss"] != results["val/loss"]


def test_overfit_batches_drives_the_loss_near_zero(toy_site, tmp_path):
    t = make_trainer(tmp_path, overrides=["train.overfit_batches=2", "train.batch_size=8", "optim.lr=0.05",
                                          "train.max_steps=80", "train.eval_every=1000"])
    seen = set()
    original = t.batches.next

    def spy():
        batch = original()
        seen.add(batch["src"].numpy().tobytes())
        return batch

    t.batches.next = spy
    losses = [t.train_step()["loss"] for _ in range(80)]
    assert len(seen) == 2  # the same two batches, over and over
    assert losses[-1] < 0.05 < losses[0]


def test_early_stopping_after_patience_evaluations(toy_site, tmp_path):
    # SGD with lr 1e-30 leaves the weights (so val/loss) exactly unchanged: no improvement
    t = make_trainer(tmp_path, "toy", ["optim.name=sgd", "optim.lr=1e-30", "train.eval_every=2",
                                       "train.max_steps=40", "train.early_stopping_patience=2"])
    t.fit()
    assert t.step == 6 and t.progress["best_step"] == 2 and t.progress["evals_since_best"] == 2


def test_grad_checkpointing_is_switched_on_or_refused(toy_site, tmp_path, monkeypatch):
    with pytest.raises(TkError, match="train.grad_checkpointing: Sequential has no set_grad_checkpointing"):
        make_trainer(tmp_path, "toy", ["train.grad_checkpointing=true"])

    class Checkpointable(nn.Sequential):
        enabled = False

        def set_grad_checkpointing(self, enable=True):
            self.enabled = enable

    import tk_toy_plugin

    monkeypatch.setattr(tk_toy_plugin.ToyTask, "build_model", lambda self: Checkpointable(nn.Linear(8, 4)))
    assert make_trainer(tmp_path, "toy", ["train.grad_checkpointing=true"]).model.enabled


def test_a_crash_while_writing_a_checkpoint_keeps_the_last_one(toy_site, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    t = make_trainer(tmp_path, "toy", ["train.save_every=1", "train.max_steps=5"], run_dir=run_dir)
    real_save, calls = torch.save, []

    def failing_save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            f.write(b"half a checkpoint")
            raise OSError("No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left on device"):
        t.fit()
    # the failed save of step 3 left step 2 intact; the save after the failure then stored step 3
    assert calls == [1, 1, 1, 1]
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 3
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_torch_compile_trains(toy_site, tmp_path):
    t = make_trainer(tmp_path, "toy", ["train.compile=true", "train.max_steps=10", "train.batch_size=32"])
    losses = [t.train_step()["loss"] for _ in range(10)]
    assert losses[-1] < losses[0]


def test_grad_checkpointing_of_the_core_vit_saves_activation_memory_with_equal_gradients():
    from tk.core.engine.summary import ActivationMeter
    from tk.core.nn.vit import VisionTransformer
    from tk.core.training.device import enable_grad_checkpointing

    measured, grads = [], []
    x = torch.randn(4, 3, 16, 16)
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = VisionTransformer(img_size=16, patch_size=4, num_classes=5, dim=32, depth=3, num_heads=2).train()
        if checkpointing:
            enable_grad_checkpointing(model)
        with ActivationMeter(model) as meter:
            loss = model(x).square().sum()
        loss.backward()
        measured.append(meter.bytes)
        grads.append([p.grad for p in model.parameters()])
    assert measured[1] < 0.5 * measured[0]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_status_json_follows_the_checkpoints_of_a_running_run(toy_site, tmp_path):
    """status.json says "running" at the step of the last checkpoint (`tk runs` of a live or killed run)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t = make_trainer(tmp_path, "toy", ["train.max_steps=6"], run_dir=run_dir)
    for _ in range(3):
        t.train_step()
    t.save_checkpoint()
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"], status["total_steps"]) == ("running", 3, 6)
