"""Recipe loading: schema, overrides, all-errors-at-once, suggestions, line numbers."""

import re
from dataclasses import dataclass
from typing import Literal

import pytest

from tk.core.config import ConfigError, build_dataclass
from tk.core.errors import TkError
from tk.core.recipe import load_config, parse_override


def test_toy_recipe_resolves_with_defaults(toy_site, toy_recipe):
    cfg, task_cls = load_config(str(toy_recipe))
    assert task_cls.__name__ == "ToyTask"
    assert cfg.train.max_steps == 40 and cfg.train.grad_accum == 1  # default filled in
    assert cfg.optim.lr == 0.01 and cfg.optim.name == "adamw"
    assert cfg.sections["data"].num_classes == 4 and cfg.sections["data"].dim == 8
    assert cfg.output_dir == "runs/toy"
    again, _ = load_config(str(toy_recipe))
    assert again.to_dict() == cfg.to_dict()


def test_overrides_parse_yaml_scalars_and_lists(toy_site, toy_recipe):
    cfg, _ = load_config(str(toy_recipe), ["optim.lr=3e-4", "optim.betas=[0.8, 0.9]",
                                           "train.clip_grad_norm=null", "model.hidden=7"])
    assert cfg.optim.lr == pytest.approx(3e-4)  # YAML reads 3e-4 as text: accepted as a number
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.train.clip_grad_norm is None
    assert cfg.sections["model"].hidden == 7
    assert parse_override("a.b=x=y") == (["a", "b"], "x=y")
    with pytest.raises(TkError, match="key.sub=value"):
        parse_override("train.max_steps")


def test_unknown_key_suggests_near_miss(toy_site, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("task: toy\noptim: {lrr: 0.1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(path) in str(e.value)
    assert "optim.lrr: unknown key; did you mean 'lr'?" in str(e.value)


def test_all_errors_reported_at_once(toy_site, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("task: toy\noptim: {lrr: 0.1}\ntrain: {batch_size: many, precision: bf61}\nmodell: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    msg = str(e.value)
    assert "4 problems" in msg
    assert "train.batch_size: expected int, found 'many' (str)" in msg
    assert "train.precision: expected one of 'fp32', 'bf16', 'fp16', found 'bf61'; did you mean 'bf16'?" in msg
    assert "modell: unknown top-level key; did you mean 'model'?" in msg


def test_override_of_missing_key_is_an_error(toy_site, toy_recipe):
    with pytest.raises(ConfigError, match=r"override 'train.max_stepz=3': unknown key 'max_stepz' in train; "
                                          r"did you mean 'max_steps'\?"):
        load_config(str(toy_recipe), ["train.max_stepz=3"])
    with pytest.raises(ConfigError, match="train.max_steps is not a section"):
        load_config(str(toy_recipe), ["train.max_steps.x=3"])


def test_cross_field_rules(toy_site, toy_recipe):
    with pytest.raises(ConfigError) as e:
        load_config(str(toy_recipe), ["train.grad_accum=0", "optim.lr=-1"])
    assert "override 'train.grad_accum=0': must be >= 1, got 0" in str(e.value)
    assert "override 'optim.lr=-1': optim.lr must be > 0" in str(e.value)
    assert "\n" not in str(e.value) and str(e.value).count("problems") == 1


def test_yaml_syntax_error_carries_line(toy_site, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: toy\ntrain:\n  batch_size: [1, 2\n  lr: 3\n")
    with pytest.raises(TkError, match=r"bad\.yaml:4:\d+: YAML syntax error"):
        load_config(str(path))


def test_missing_recipe_lists_builtins():
    with pytest.raises(TkError, match="recipe not found: 'nope.yaml'.*built-in recipes"):
        load_config("nope.yaml")


def test_unknown_task_lists_available(toy_site, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("task: toyy\n")
    with pytest.raises(TkError, match=r"unknown task 'toyy'; did you mean 'toy'\? \(available: .*toy"):
        load_config(str(path))


def test_missing_task_and_non_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data: {}\n")
    with pytest.raises(ConfigError, match="task: missing"):
        load_config(str(path))
    path.write_text("- a\n- b\n")
    with pytest.raises(TkError, match="must be a mapping"):
        load_config(str(path))


@dataclass
class _Nested:
    kind: Literal["a", "b"] = "a"  # choice
    sizes: list[int] = None  # list
    ratio: float | None = None  # optional number


def test_build_dataclass_types():
    errors: list[str] = []
    obj = build_dataclass(_Nested, {"kind": "b", "sizes": [1, "2", 3.0], "ratio": 1}, "x", errors)
    assert errors == [] and obj.sizes == [1, 2, 3] and obj.ratio == 1.0
    build_dataclass(_Nested, {"sizes": [1, 2.5], "ratio": True}, "x", errors)
    assert errors == ["x.sizes[1]: expected int, found 2.5 (float)",
                      "x.ratio: expected float or null, found True (bool)"]


def test_duplicate_keys_are_refused_with_file_and_line(toy_site, tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("task: toy\noptim:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(TkError, match=r"dup\.yaml:4:3: duplicate key 'lr' \(first at line 3\)"):
        load_config(str(path))
    with pytest.raises(TkError, match=r"override 'optim=\{lr: 1, lr: 2\}'.*duplicate key 'lr'"):
        load_config(_ok(tmp_path), ["optim={lr: 1, lr: 2}"])


def _ok(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("task: toy\n")
    return str(path)


def test_broken_override_values_and_null_sections_are_errors(toy_site, tmp_path):
    with pytest.raises(TkError, match=r"override 'optim.betas=\[0.9,': the value is not valid YAML"):
        load_config(_ok(tmp_path), ["optim.betas=[0.9,"])
    with pytest.raises(TkError, match=r"^override 'model=null': null is not a section; remove the key"):
        load_config(_ok(tmp_path), ["model=null"])
    path = tmp_path / "null.yaml"
    path.write_text("task: toy\nmodel:\n")
    with pytest.raises(TkError, match=r"null\.yaml: model: null is not a section"):
        load_config(str(path))
    cfg, _ = load_config(_ok(tmp_path), ["optim.betas=[0.8, 0.9]", "data.num_classes=3"])  # valid ones still work
    assert cfg.optim.betas == [0.8, 0.9] and cfg.sections["data"].num_classes == 3


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "nan", "inf", "1e999"])
def test_non_finite_floats_are_refused(toy_site, tmp_path, value):
    with pytest.raises(TkError, match=rf"override 'optim.lr={re.escape(value)}': expected a finite number"):
        load_config(_ok(tmp_path), [f"optim.lr={value}"])


def test_every_problem_at_once_in_one_line(toy_site, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_ok(tmp_path), ["train.batch_size=abc", "optim.lr=0", "model.dimm=3", "optim.betas=[1,"])
    msg = str(e.value)
    assert "\n" not in msg and "4 problems" in msg
    for part in ("override 'train.batch_size=abc': expected int", "override 'optim.lr=0': optim.lr must be > 0",
                 "override 'model.dimm=3': unknown key 'dimm'", "override 'optim.betas=[1,': the value is not"):
        assert part in msg
    assert len(e.value.problems) == 4


def test_unreadable_recipes_name_the_file(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    with pytest.raises(TkError, match=r"bin\.yaml: not a UTF-8 text file \(byte 0 is b'\\x89'\)"):
        load_config(str(tmp_path / "bin.yaml"))
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(TkError, match=r"is a folder, not a YAML file"):
        load_config(str(tmp_path / "dir.yaml"))


def test_task_that_is_not_a_task_class(tmp_path):
    path = tmp_path / "os.yaml"
    path.write_text("task: os:path\n")
    with pytest.raises(TkError, match="not a subclass of tk.core.task.Task; `task: module:Class` must name"):
        load_config(str(path))


def test_yaml_merge_keys_may_be_overridden_without_a_duplicate_error(toy_site, tmp_path):
    path = tmp_path / "merge.yaml"
    base = "task: toy\noptim:\n  <<: {lr: 0.5, weight_decay: 0.1}\n  lr: 0.25\n"
    path.write_text(base)
    cfg, _ = load_config(str(path))
    assert cfg.optim.lr == 0.25 and cfg.optim.weight_decay == 0.1


def test_strategy_compile_mode_and_optimiser_kernels(toy_site, toy_recipe):
    cfg, _ = load_config(str(toy_recipe), ["train.strategy=fsdp", "train.compile_mode=max-autotune", "optim.fused=true"])
    assert (cfg.train.strategy, cfg.train.compile_mode, cfg.optim.fused, cfg.optim.foreach) == \
        ("fsdp", "max-autotune", True, None)
    with pytest.raises(ConfigError) as e:
        load_config(str(toy_recipe), ["train.strategy=zero3", "train.compile_mode=fast", "train.strategy=fsdp",
                                      "train.ema_decay=0.9", "optim.foreach=true", "optim.fused=true"])
    msg = str(e.value)
    assert "override 'train.compile_mode=fast': expected one of 'default', 'reduce-overhead', 'max-autotune'" in msg
    assert "EMA is not supported with train.strategy: fsdp" in msg and "choose one of them" in msg
