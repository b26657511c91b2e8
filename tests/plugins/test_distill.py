"""Distillation in the image_classification plugin: DeiT loss, distillation token, teacher."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.nn.vit import VisionTransformer
from tk.plugins.image_classification.distill import DistillConfig, distillation_loss, load_teacher
from tk.plugins.image_classification.model import both_heads

TINY = ["model.patch_size=8", "model.dim=32", "model.depth=1", "model.num_heads=2", "data.num_train=64",
        "data.num_val=32", "train.batch_size=16", "train.eval_batch_size=32", "train.num_workers=0",
        "train.progress=false", "train.seed=0", "train.log_every=1"]


def tk_run(run_dir, *overrides):
    result = CliRunner().invoke(cli, ["run", "quickstart", f"output_dir={run_dir}", *TINY, *overrides],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_soft_loss_equals_hand_computation():
    torch.manual_seed(0)
    cls, dist, teacher = torch.randn(3, 4, 5).unbind(0)
    labels = torch.tensor([0, 3, 1, 4])
    cfg = DistillConfig(type="soft", alpha=0.3, tau=2.0, teacher="x")
    loss, count, logs = distillation_loss(cfg, (cls, dist), labels, teacher)
    base = sum(-math.log(F.softmax(cls[i], -1)[labels[i]].item()) for i in range(4))
    kl = 0.0
    for i in range(4):
        p_t, p_s = F.softmax(teacher[i] / 2, -1), F.softmax(dist[i] / 2, -1)
        kl += sum(p_t[c].item() * math.log(p_t[c].item() / p_s[c].item()) for c in range(5))
    assert count == 4
    assert loss.item() == pytest.approx(0.7 * base + 0.3 * 4.0 * kl, rel=1e-5)  # tau^2 = 4
    assert logs["loss_distill"].item() == pytest.approx(4.0 * kl, rel=1e-5)


def test_hard_loss_equals_hand_computation_and_single_head():
    torch.manual_seed(1)
    logits, teacher = torch.randn(2, 3, 4).unbind(0)
    labels = torch.tensor([2, 0, 1])
    loss, _, _ = distillation_loss(DistillConfig(type="hard", alpha=0.5, teacher="x"), logits, labels, teacher)
    ce = lambda z, y: -math.log(F.softmax(z, -1)[y].item())
    hard = teacher.argmax(-1)
    expected = sum(0.5 * ce(logits[i], labels[i]) + 0.5 * ce(logits[i], hard[i]) for i in range(3))
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_distilled_vit_eval_is_mean_of_heads():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=8, dim=16, depth=1, num_heads=2, num_classes=3, distilled=True)
    x = torch.randn(2, 3, 16, 16)
    cls, dist = model.train()(x)
    model.eval()
    with torch.no_grad():
        avg = model(x)
        c, d = both_heads(model, x)
    torch.testing.assert_close(c, cls.detach())
    torch.testing.assert_close(d, dist.detach())
    torch.testing.assert_close(avg, (c + d) / 2)


@pytest.mark.slow
def test_distillation_run_from_a_tk_teacher(tmp_path):
    """A teacher trained by tk, then a DeiT student distilled from its run dir: both heads
    logged, the teacher untouched; resuming with another teacher and a teacher with other
    classes fail before training."""
    teacher_dir = tmp_path / "teacher"
    tk_run(teacher_dir, "train.max_steps=4")
    from tk.core.engine.inference import load_run

    _, teacher = load_run(teacher_dir)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}

    student_dir = tmp_path / "student"
    metrics = tk_run(student_dir, "train.max_steps=6", "train.eval_every=3", "model.distilled=true",
                     "distill.type=soft", "distill.tau=2.0", f"distill.teacher={teacher_dir}")
    val = [m for m in metrics if "val/top1" in m][-1]
    assert {"val/top1", "val/top1_cls", "val/top1_dist"} <= set(val)
    assert any("loss_distill" in m for m in metrics if m["split"] == "train"), metrics[0]
    ckpt = torch.load(student_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    record = [v["teacher"] for v in ckpt.values() if isinstance(v, dict) and "teacher" in v]
    assert record and record[0]["teacher"] == str(teacher_dir.resolve()) and len(record[0]["sha256"]) == 64
    _, teacher_after = load_run(teacher_dir)
    for k, v in teacher_after.state_dict().items():
        torch.testing.assert_close(v, before[k])

    # resume with another teacher (a timm model) fails, naming both
    other = CliRunner().invoke(cli, ["run", "quickstart", f"output_dir={student_dir}", *TINY, "train.max_steps=8",
                                     "model.distilled=true", "distill.type=hard", "distill.teacher=resnet18",
                                     "--resume"])
    assert other.exit_code != 0
    assert "resnet18" in other.output and str(teacher_dir.resolve()) in other.output


def test_teacher_with_other_class_names_fails(tmp_path):
    teacher_dir = tmp_path / "teacher"
    tk_run(teacher_dir, "train.max_steps=1")
    from tk.plugins.image_classification.synthetic import CLASS_NAMES

    names = list(CLASS_NAMES)
    load_teacher(DistillConfig(type="soft", teacher=str(teacher_dir)), names)  # same classes: fine
    with pytest.raises(TkError, match="share the class list"):
        load_teacher(DistillConfig(type="soft", teacher=str(teacher_dir)), ["other"] + names[1:])


def test_a_teacher_typo_or_missing_run_fails_before_training(tmp_path):
    """A bare teacher name that is no timm model fails `tk validate`; a teacher path that does
    not exist fails `tk validate` and `tk run` with the same line (issue #35 item 5), before the run dir."""
    result = CliRunner().invoke(cli, ["validate", "quickstart", "distill.type=hard", "distill.teacher=resnet18x",
                                      "model.distilled=true"])
    assert result.exit_code == 2, result.output
    assert "distill.teacher" in result.output and "resnet18x" in result.output and "resnet18" in result.output
    missing = tmp_path / "runs" / "no_teacher"
    refused = CliRunner().invoke(cli, ["validate", "quickstart", "distill.type=hard", f"distill.teacher={missing}"])
    assert refused.exit_code == 2 and f"{missing} does not exist" in refused.stderr, refused.output
    run = CliRunner().invoke(cli, ["run", "quickstart", "distill.type=hard", f"distill.teacher={missing}",
                                   f"output_dir={tmp_path / 'out'}", *TINY])
    assert run.exit_code == 2 and run.stderr == refused.stderr
    assert not (tmp_path / "out").exists()


def test_teacher_gets_no_grad():
    from tk.core.training.build import prepare_teacher

    teacher = prepare_teacher(torch.nn.Linear(3, 2), torch.device("cpu"))
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())


def test_timm_deit_distilled_works_like_the_tk_vit(tmp_path):
    """model.timm: deit_*_distilled_* returns both heads in training (set_distilled_training)
    and their mean in eval; a distillation step runs and logs both heads."""
    from tk.core.recipe import load_config

    cfg, task_cls = load_config("quickstart", ["model.timm=deit_tiny_distilled_patch16_224", "data.img_size=32",
                                               "distill.type=hard", "distill.teacher=resnet18"])
    task = task_cls(cfg)
    task.setup()
    model = task.build_model()
    task.teacher = task.build_teacher().eval().requires_grad_(False)
    batch = {"image": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 3])}
    out = task.loss(model.train(), batch)
    out.loss.backward()
    assert set(out.logs) == {"loss_base", "loss_distill"}
    assert all(p.grad is None for p in task.teacher.parameters())
    model.eval()
    with torch.no_grad():
        step = task.eval_step(model, batch, None)
        torch.testing.assert_close(model(batch["image"]), step.outputs["logits"])
        torch.testing.assert_close(step.outputs["logits"], (step.outputs["cls"] + step.outputs["dist"]) / 2)
    assert {"head_cls", "head_dist"} <= set(task.build_metrics(None))
