"""docs/plugins.md's `### Reference` (under `## The contract`) against the code, so the written
plugin contract cannot drift from it (issue #52).

The reference lists, under one `#### `dotted.name`` heading per class or module, one bullet per
public member whose first code span is the member exactly as :func:`render` writes it from the
code (the signature as ``inspect.signature`` gives it, annotations as written). A member is
*public* when its name does not start with ``_`` and the class defines it itself (inherited ones
belong to their own class): the class's ``__init__`` (not one ``@dataclass`` generates), what its
own ``__dict__`` holds (methods, classmethods, properties, class attributes), its own annotations
(``ClassVar`` attributes, dataclass fields) and the attributes its own ``__init__`` assigns to
``self``; a module's members are its ``__all__``. Every public member must be listed with the
code's rendering and every listed one must exist; a failure names the member and prints the line
to paste. `#### Call order of `tk run`` is compared with what a recording task sees in a real
(tiny, one-process) ``tk run``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
SECTION = "### Reference"
ORDER_HEADING = "#### Call order of `tk run`"
OBJECT_HEADING = re.compile(r"^#### `([A-Za-z_][\w.]*)`")
BULLET = re.compile(r"^- ((?:`[^`]+`)(?:(?:, | / )`[^`]+`)*)")
NUMBERED = re.compile(r"^\d+\. ((?:`[^`]+`)(?:(?:, | / )`[^`]+`)*)")
SPAN = re.compile(r"`([^`]+)`")


# -- rendering the code ------------------------------------------------------------------------
class _Raw:
    """An annotation shown as written (``from __future__ import annotations`` keeps it a string)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _ann(annotation: Any) -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    return _Raw(annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))


def signature(fn: Any) -> str:
    """``(self, resume: bool = False) -> None``: ``inspect.signature`` with annotations unquoted."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=_ann(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=_ann(sig.return_annotation)))


def _value(value: Any) -> str:
    if isinstance(value, type):
        return value.__qualname__
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def _self_attributes(cls: type) -> dict[str, str]:
    """``self.x`` (``self.x: T`` where annotated) for what the class's own ``__init__`` assigns."""
    init = vars(cls).get("__init__")
    if not inspect.isfunction(init) or dataclasses.is_dataclass(cls):  # a dataclass's: generated, its fields
        return {}
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    found: dict[str, str] = {}

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, (ast.Tuple, ast.List)):
            return [t for elt in node.elts for t in targets(elt)]
        return [node]

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, None) for target in node.targets for t in targets(target)]
        elif isinstance(node, ast.AnnAssign):
            pairs = [(node.target, ast.unparse(node.annotation))]
        else:
            continue
        for target, annotation in pairs:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self" and not target.attr.startswith("_")):
                name = f"self.{target.attr}"
                if annotation is not None or name not in found:
                    found[name] = name + (f": {annotation}" if annotation else "")
    return found


def class_members(cls: type) -> dict[str, str]:
    """Every public member of ``cls`` (see the module docstring), name -> its rendering."""
    out: dict[str, str] = {}
    is_dc = dataclasses.is_dataclass(cls)
    if is_dc:
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            default = "" if f.default is dataclasses.MISSING else f" = {_value(f.default)}"
            if f.default_factory is not dataclasses.MISSING:
                default = f" = field(default_factory={_value(f.default_factory)})"
            out[f.name] = f"{f.name}: {_ann(f.type)}{default}"
    for name, annotation in vars(cls).get("__annotations__", {}).items():
        if name.startswith("_") or name in out:
            continue
        value = f" = {_value(vars(cls)[name])}" if name in vars(cls) else ""
        out[name] = f"{name}: {_ann(annotation)}{value}"
    for name, raw in vars(cls).items():
        if name in out or (name.startswith("_") and name != "__init__"):
            continue
        if name == "__init__":
            if not is_dc and inspect.isfunction(raw):
                out[name] = f"__init__{signature(raw)}"
        elif isinstance(raw, classmethod):
            out[name] = f"@classmethod {name}{signature(raw.__func__)}"
        elif isinstance(raw, staticmethod):
            out[name] = f"@staticmethod {name}{signature(raw.__func__)}"
        elif isinstance(raw, property):
            returns = inspect.signature(raw.fget).return_annotation if raw.fget else inspect.Parameter.empty
            out[name] = f"@property {name}" + ("" if returns is inspect.Parameter.empty else f" -> {_ann(returns)}")
        elif inspect.isfunction(raw):
            out[name] = f"{name}{signature(raw)}"
        else:
            out[name] = f"{name} = {_value(raw)}"
    for name, text in _self_attributes(cls).items():
        out.setdefault(name, text)
    return out


def module_members(module: types.ModuleType) -> dict[str, str]:
    """The module's ``__all__``, name -> its rendering (a class as ``class Name``: it has its own heading)."""
    out = {}
    for name in module.__all__:
        value = getattr(module, name)
        if isinstance(value, type):
            out[name] = f"class {name}"
        elif inspect.isfunction(value):
            out[name] = f"{name}{signature(value)}"
        else:
            out[name] = f"{name} = {_value(value)}"
    return out


def resolve(dotted: str) -> Any:
    """``tk.core.step.StepOutput`` -> the object (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def members(obj: Any) -> dict[str, str]:
    return module_members(obj) if isinstance(obj, types.ModuleType) else class_members(obj)


def member_key(span: str) -> str:
    """The member a rendering (or a documented span) names: ``@classmethod check_config(cls, ...)`` ->
    ``check_config``, ``self.files`` -> ``self.files``."""
    for prefix in ("@classmethod ", "@staticmethod ", "@property ", "class "):
        span = span.removeprefix(prefix)
    match = re.match(r"(self\.)?[A-Za-z_]\w*", span)
    return match.group(0) if match else span


# -- reading the doc ---------------------------------------------------------------------------
def reference_section(doc: str) -> str:
    """The text of `### Reference`, up to the next `##`/`###` heading."""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == SECTION]
    if len(starts) != 1:
        raise AssertionError(f"{DOC} must have exactly one '{SECTION}' heading (under '## The contract'), "
                             f"found {len(starts)}")
    end = next((j for j in range(starts[0] + 1, len(lines)) if re.match(r"^#{2,3} ", lines[j])), len(lines))
    return "\n".join(lines[starts[0] + 1:end])


@dataclass
class Reference:
    objects: dict[str, dict[str, str]]  # heading -> member key -> documented span
    duplicates: list[str]  # "heading: member" documented twice
    order: list[str]  # the hook names of the call-order list, in order


def parse_reference(section: str) -> Reference:
    objects: dict[str, dict[str, str]] = {}
    duplicates, order = [], []
    current, in_order = None, False
    for line in section.splitlines():
        if line.startswith("#### "):
            match = OBJECT_HEADING.match(line)
            current = match.group(1) if match else None
            in_order = line.strip() == ORDER_HEADING
            if current is not None:
                objects.setdefault(current, {})
            continue
        if current is not None and (match := BULLET.match(line)):
            for span in SPAN.findall(match.group(1)):
                key = member_key(span)
                if key in objects[current]:
                    duplicates.append(f"{current}: {key}")
                objects[current][key] = span
        elif in_order and (match := NUMBERED.match(line)):
            order += SPAN.findall(match.group(1))
    return Reference(objects, duplicates, order)


def check_reference(section: str) -> list[str]:
    """Every way the reference and the code disagree, one line each, saying what to paste."""
    ref = parse_reference(section)
    where = f"{DOC.name} ({SECTION})"
    problems = [f"{where} lists {d} twice" for d in ref.duplicates]
    if not ref.objects:
        problems.append(f"{where} has no '#### `dotted.name`' headings")
    for heading, documented in ref.objects.items():
        try:
            obj = resolve(heading)
        except (ImportError, AttributeError) as e:
            problems.append(f"{where}: #### `{heading}` names nothing importable ({type(e).__name__}: {e}); "
                            f"fix the heading or drop its listing")
            continue
        code = members(obj)
        short = heading.rsplit(".", 1)[-1]
        for key, rendered in code.items():
            if key not in documented:
                problems.append(f"{short}.{key} is public in the code but missing from {where} under "
                                f"#### `{heading}`; add:\n    - `{rendered}`: <when it is called, in which process, "
                                f"what it may rely on>")
            elif documented[key] != rendered:
                problems.append(f"{short}.{key} changed: {where} says\n    `{documented[key]}`\n  the code has\n"
                                f"    `{rendered}`\n  replace it with the code's (and check its description)")
        for key in documented.keys() - code.keys():
            problems.append(f"{where} documents {short}.{key} (`{documented[key]}`), which the code does not "
                            f"have (or no longer has publicly); remove the line or restore the member")
    return problems


def test_the_reference_matches_the_code():
    problems = check_reference(reference_section(DOC.read_text(encoding="utf-8")))
    assert not problems, "docs/plugins.md's plugin reference drifted from the code:\n" + "\n".join(problems)


def test_the_reference_covers_the_contract():
    """The objects a plugin implements or calls are all there (a heading dropped is no escape)."""
    ref = parse_reference(reference_section(DOC.read_text(encoding="utf-8")))
    assert {"tk.core.task.Task", "tk.core.step.StepOutput", "tk.core.step.EvalContext", "tk.core.metrics.Metric",
            "tk.core.artifacts.TaskFiles", "tk.core.nn.text_encoder", "tk.core.nn.text_encoder.TextEncoder",
            "tk.core.exchange.pretrained", "tk.core.exchange.pretrained.SourceRun"} <= set(ref.objects)
    assert ref.order, f"{ORDER_HEADING} lists no hooks"


# -- the checker can fail ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def section() -> str:
    return reference_section(DOC.read_text(encoding="utf-8"))


def test_a_changed_hook_signature_is_reported_with_the_codes_line(section, monkeypatch):
    from tk.core.task import Task

    def setup(self, resume: bool = False, *, fast: bool = True) -> None:
        """A new keyword."""

    monkeypatch.setattr(Task, "setup", setup)
    problems = check_reference(section)
    assert len(problems) == 1, problems
    assert problems[0].startswith("Task.setup changed") and \
        "`setup(self, resume: bool = False, *, fast: bool = True) -> None`" in problems[0]


def test_a_new_public_member_and_a_removed_hook_are_reported(section, monkeypatch):
    from tk.core.task import Task

    monkeypatch.setattr(Task, "warm_up", lambda self, model: None, raising=False)
    monkeypatch.delattr(Task, "transform_batch")
    problems = check_reference(section)
    assert len(problems) == 2, problems
    assert any(p.startswith("Task.warm_up is public in the code but missing") and "- `warm_up(self, model)`" in p
               for p in problems), problems
    assert any("documents Task.transform_batch" in p and "does not have" in p for p in problems), problems


def test_a_hook_missing_from_the_doc_is_reported(section):
    from tk.core.task import Task

    line = next(line for line in section.splitlines() if line.startswith("- `eval_step("))
    problems = check_reference(section.replace(line + "\n", ""))
    assert problems == [problems[0]] and problems[0].startswith("Task.eval_step is public in the code but missing")
    assert f"`eval_step{signature(Task.eval_step)}`" in problems[0]


def test_other_listings_are_checked_too(section, monkeypatch):
    from tk.core.metrics import Metric
    from tk.core.step import StepOutput

    monkeypatch.setattr(Metric, "update", lambda self, out, batch, ctx=None: None)
    renamed = section.replace("`num_items: ", "`count: ", 1)
    problems = check_reference(renamed)
    assert any(p.startswith("Metric.update changed") for p in problems), problems
    assert any(p.startswith("StepOutput.num_items is public in the code but missing") for p in problems), problems
    assert any("documents StepOutput.count" in p for p in problems), problems
    assert StepOutput.__dataclass_fields__["num_items"]  # the doc's name for the field is the code's


def test_a_heading_that_names_nothing_is_reported(section):
    problems = check_reference(section + "\n#### `tk.core.task.NoSuchClass`\n\n- `x`: y\n")
    assert problems == [problems[0]] and "names nothing importable" in problems[0]


# -- the call order ----------------------------------------------------------------------------
RECIPE = """\
task: tk_reference_recorder:RecorderTask
optim: {lr: 0.01}
train: {max_steps: 1, eval_every: 1, batch_size: 16, best_metric: val/top1, device: cpu, progress: false, curves: false}
"""


def recorder_module(calls: list[str]) -> types.ModuleType:
    """A module holding ``RecorderTask``: every function and classmethod ``Task`` defines is wrapped to
    append its name to ``calls`` when the engine calls it (not when another hook does: the default
    ``eval_step`` calling ``loss`` is one call of ``eval_step``)."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from tk.core.metrics import Accuracy
    from tk.core.step import StepOutput
    from tk.core.task import Task

    @dataclass
    class Data:
        num: int = 16  # samples per split: one batch

    @dataclass
    class Model:
        hidden: int = 4  # unused

    class Base(Task):
        """Records the engine's calls (test plugin)."""

        name = "recorder"
        DataConfig, ModelConfig = Data, Model

        def build_dataset(self, split):
            x = torch.randn(self.data.num, 4, generator=torch.Generator().manual_seed(0))
            return TensorDataset(x, (x[:, 0] > 0).long())

        def collate(self, samples):
            x, y = torch.utils.data.default_collate(samples)
            return {"x": x, "labels": y}

        def build_model(self):
            return nn.Linear(4, 2)

        def loss(self, model, batch):
            logits = model(batch["x"])
            return StepOutput(nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"),
                              batch["labels"].numel(), outputs=logits.detach())

        def build_metrics(self, ctx):
            return {"acc": Accuracy()}

    depth = [0]

    def recorded(name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0] == 0:
                calls.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    wrapped = {}
    for name, raw in vars(Task).items():
        if name.startswith("_") and name != "__init__":
            continue
        impl = vars(Base).get(name, raw)
        if isinstance(impl, classmethod):
            wrapped[name] = classmethod(recorded(name, impl.__func__))
        elif inspect.isfunction(impl):
            wrapped[name] = recorded(name, impl)
    module = types.ModuleType("tk_reference_recorder")
    module.RecorderTask = type("RecorderTask", (Base,), {**wrapped, "__module__": module.__name__})
    return module


def collapse(calls: list[str]) -> list[str]:
    """Consecutive repeats as one (four ``build_metrics`` of one check, ``build_loader`` train then val)."""
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


def order_problems(documented: list[str], seen: list[str]) -> list[str]:
    if documented == seen:
        return []
    first = next((i for i, (a, b) in enumerate(zip(documented, seen)) if a != b), min(len(documented), len(seen)))
    return [f"{ORDER_HEADING} in {DOC.name} lists the hooks as\n    {' -> '.join(documented)}\n"
            f"but a fresh one-process `tk run` (one update, evaluated, train.best_metric set) calls\n"
            f"    {' -> '.join(seen)}\n(first difference at position {first + 1}); fix the list (and the prose "
            f"around it) or the engine"]


def test_the_documented_call_order_is_what_tk_run_does(section, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from tk.core.cli import cli

    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "tk_reference_recorder", recorder_module(calls))
    recipe = tmp_path / "recorder.yaml"
    recipe.write_text(RECIPE)
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output + result.stderr
    problems = order_problems(parse_reference(section).order, collapse(calls))
    assert not problems, problems[0]


def test_a_wrong_order_is_reported(section):
    order = parse_reference(section).order
    i = order.index("build_teacher")
    swapped = order[:i] + [order[i + 1], order[i]] + order[i + 2:]
    problems = order_problems(swapped, order)
    assert problems and f"position {i + 1}" in problems[0]
