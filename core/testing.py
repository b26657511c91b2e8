"""Checks for a task plugin's own tests: the promises tk's built-in tasks are tested for, each one
proved for the plugin's task in one call (docs/plugins.md, "Testing a plugin"): ``check_step``,
``check_accumulation``, ``check_resume``, ``check_two_processes`` (slow), ``check_predict``,
``check_export``. Each takes a recipe (name or path) and ``key=value`` overrides that make the run
tiny, runs it through the engine itself (the Trainer; ``tk`` through click's CliRunner; ``load_run``),
raises ``AssertionError`` naming what broke and by how much, and returns what it measured. Nothing
here needs pytest; the global RNGs a run seeds are put back after each check.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.engine.inference import load_run
from tk.core.engine.predict import format_record
from tk.core.engine.train import Trainer
from tk.core.recipe import load_config
from tk.core.step import StepOutput
from tk.core.training.device import move_to_device
from tk.core.training.precision import Precision

__all__ = ["check_step", "check_accumulation", "check_resume", "check_two_processes", "check_predict",
           "check_export", "train_run", "EXPORT_FORMATS"]

EXPORT_FORMATS = ("safetensors", "torch-export", "onnx", "hf", "timm", "peft")
VOLATILE = frozenset({"time", "items_per_s", "data_wait"})  # metrics.jsonl keys that read the clock
QUIET = ("train.progress=false", "train.num_workers=0")


# -- shared pieces ---------------------------------------------------------------------------
def _require(ok: Any, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextlib.contextmanager
def _isolated(tmp_path: str | Path | None) -> Iterator[Path]:
    """A scratch folder (``tmp_path``, else a temporary one); the RNGs and determinism switch put back after."""
    states, deterministic = (random.getstate(), np.random.get_state(), torch.get_rng_state()), \
        torch.are_deterministic_algorithms_enabled()
    with contextlib.ExitStack() as stack:
        root = Path(tmp_path) if tmp_path is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        try:
            yield root
        finally:
            random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])
            torch.use_deterministic_algorithms(deterministic)


def _tk(args: Sequence[Any], expect: int | None = 0):
    """``tk ARGS`` in this process; AssertionError with its output when it does not exit ``expect``."""
    result = CliRunner().invoke(cli, [str(a) for a in args])
    _require(expect is None or result.exit_code == expect, f"`tk {' '.join(map(str, args))}` exited "
             f"{result.exit_code}, expected {expect}:\n{result.output.strip()}")
    return result


def train_run(recipe: str | Path, run_dir: str | Path, overrides: Sequence[str] = (), flags: Sequence[str] = ()):
    """``tk run RECIPE OVERRIDES output_dir=RUN_DIR FLAGS`` in this process (AssertionError unless it
    exits 0): the run dir, e.g. for :func:`check_predict` and :func:`check_export`."""
    _tk(["run", recipe, *QUIET, *overrides, f"output_dir={run_dir}", *flags])
    return Path(run_dir)


def _config(recipe: str | Path, overrides: Sequence[str]):
    return load_config(str(recipe), [*QUIET, *overrides])


def _dropout_hint(model: torch.nn.Module) -> str:
    """A note naming the model's dropout, which draws other masks for other batch shapes or processes."""
    found = [n for n, m in model.named_modules() if "Dropout" in type(m).__name__ and getattr(m, "p", 0) > 0]
    return (f"; note: the model has dropout ({', '.join(found[:3])}), which draws other masks for other batch "
            f"shapes or processes: turn it off with an override") if found else ""


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to ``b``'s largest magnitude (absolute where that is below 1)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape or not b.numel():
        return 0.0 if a.shape == b.shape else math.inf
    return float((a - b).abs().max() / max(float(b.abs().max()), 1.0))


def _within(gap: float, tol: float) -> str | None:
    """None where ``gap`` is within ``tol`` (NaN never is), else how it is not."""
    return None if gap <= tol else f"by {gap:.3g} ({'must be equal' if tol == 0 else f'allowed {tol:g}'})"


def _same(a: Any, b: Any, tol: float) -> bool:
    """JSON values equal, numbers within ``tol`` (relative above 1)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or not all(isinstance(v, (int, float)) for v in (a, b)):
        return a == b
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol * max(1.0, abs(b))


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} for line in lines if line.strip()]


def _compare_runs(got: Path, want: Path, tol: float, what: str) -> None:
    """Two run dirs: the same ``metrics.jsonl`` records (numbers within ``tol``, 0: equal) and weights."""
    from safetensors.torch import load_file

    ours, ref = _records(got), _records(want)
    keys = [[(r.get("step"), r.get("split")) for r in run] for run in (ours, ref)]
    _require(keys[0] == keys[1], f"{what}: metrics.jsonl holds other records, (step, split) {keys[0]} vs {keys[1]}")
    for o, r in zip(ours, ref):
        for key in sorted(set(o) | set(r), key=lambda k: (k != "loss", k)):
            a, b = o.get(key), r.get(key)
            numbers = all(isinstance(v, (int, float)) for v in (a, b))
            _require(_same(a, b, tol), f"{what}: step {r['step']} ({r['split']}) logged {key}={a!r}, the reference "
                     f"{b!r}" + (f": they differ {_within(abs(a - b), tol)}" if numbers else ""))
    for name in ("model.safetensors", "model_ema.safetensors"):
        if (want / name).is_file():
            ours, ref = load_file(got / name), load_file(want / name)
            _require(ours.keys() == ref.keys(), f"{what}: {name} holds other tensors: {ours.keys() ^ ref.keys()}")
            for key in ref:
                off = None if torch.equal(ours[key], ref[key]) else _within(_gap(ours[key], ref[key]) or math.nan, tol)
                _require(off is None, f"{what}: {name}: {key} differs {off}")


# -- one step ------------------------------------------------------------------------------------
def check_step(recipe: str | Path, overrides: Sequence[str] = (), tmp_path: str | Path | None = None) -> dict:
    """One training batch of the Trainer ``tk run`` builds through ``transform_batch`` and ``Task.loss``:
    a ``StepOutput`` whose loss is a finite scalar with a gradient, ``num_items`` > 0, finite logs;
    backward gives every trainable parameter a finite gradient (DDP needs each one used), some a
    non-zero one. Returns ``{"loss": per item, "num_items", "parameters": trainable tensors}``."""
    with _isolated(tmp_path) as root:
        trainer = Trainer(*_config(recipe, overrides), root / "check_step")
        task, model, name = trainer.task, trainer.model, f"{type(trainer.task).__name__}.loss"
        trainer.train_model.train()
        batch = move_to_device(trainer.batches.next(), trainer.device)
        with trainer.precision.autocast():
            out = task.loss(trainer.train_model, task.transform_batch(batch, training=True))
        _require(isinstance(out, StepOutput), f"{name} returned {type(out).__name__}, not a tk.core.step.StepOutput")
        loss, items = out.loss, float(out.num_items)
        _require(torch.is_tensor(loss) and loss.numel() == 1, f"{name}: loss must be a scalar tensor (summed over "
                 f"the batch), got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        _require(torch.isfinite(loss.detach()).all(), f"{name}: the loss of a training batch is {float(loss.detach())}")
        _require(items > 0, f"{name}: num_items is {items}; it counts what the loss is summed over (> 0)")
        _require(all(math.isfinite(float(v)) for v in out.logs.values()), f"{name}: logs not finite: {out.logs}")
        _require(loss.requires_grad, f"{name}: the loss has no gradient (computed under no_grad, or detached)")
        (loss.float().reshape(()) / items).backward()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n, p in params if p.grad is None]
        _require(not missing, f"{name}: {len(missing)} trainable parameters get no gradient ({', '.join(missing[:4])});"
                 f" DDP (tk run --nproc-per-node) fails on unused parameters: use them or freeze them")
        bad = [n for n, p in params if not torch.isfinite(p.grad).all()]
        _require(not bad, f"{name}: non-finite gradients in {len(bad)} parameters ({', '.join(bad[:4])})")
        _require(not params or any(p.grad.any() for _, p in params),
                 f"{name}: every gradient is zero: the loss does not depend on the model's parameters")
        return {"loss": float(loss.detach()) / items, "num_items": items, "parameters": len(params)}


# -- gradient accumulation ------------------------------------------------------------------------
def check_accumulation(recipe: str | Path, tmp_path: str | Path | None = None, overrides: Sequence[str] = (),
                       steps: int = 3, accum: int = 4, tol: float = 1e-4) -> dict[str, Any]:
    """``steps`` updates of the same B items (B = ``batch_size x grad_accum``; ``train.seed`` picks them
    from the map-style train dataset) collated by the task as one batch and as ``accum`` micro-batches,
    each update from the same weights through the Trainer's update. The engine divides the summed loss
    by all items of the update, so a loss summed over exactly the items it counts (no padding) gives the
    same item counts, losses and gradients, within ``tol`` (relative to each tensor's largest value).
    Dropout must be off. Returns ``{"losses": per update, "max_grad_gap"}``."""
    with _isolated(tmp_path) as root:
        cfg, _ = _config(recipe, overrides)
        size = cfg.train.batch_size * cfg.train.grad_accum
        if accum < 2 or size % accum:
            raise ValueError(f"accum={accum} must be >= 2 and divide train.batch_size x train.grad_accum = {size}")
        runs, grads = {}, {}
        for k in (1, accum):
            cfg, task_cls = _config(recipe, [*overrides, f"train.batch_size={size // k}", f"train.grad_accum={k}"])
            runs[k] = trainer = Trainer(cfg, task_cls, root / f"accumulation_{k}")
            data = trainer.task.build_dataset("train")
            if len(data) < steps * size:
                raise ValueError(f"{steps} updates of {size} items need {steps * size} training items, not {len(data)}")
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.train.seed))[:steps * size]
            batches = [trainer.task.collate([data[i] for i in order[j:j + size // k].tolist()])
                       for j in range(0, steps * size, size // k)]
            trainer.batches = SimpleNamespace(next=iter(batches).__next__)  # these items, grouped so
            grads[k] = seen = []
            params = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
            trainer.optimizer.register_step_pre_hook(lambda *_, params=params, seen=seen: seen.append(
                {n: p.grad.clone() for n, p in params if p.grad is not None}))
        what = f"{size} items as 1 batch vs {accum} micro-batches{_dropout_hint(runs[1].model)}"
        stats: dict[int, list] = {1: [], accum: []}
        for _ in range(steps):  # Adam makes float noise in near-zero gradients visible in the weights: start equal
            runs[accum].model.load_state_dict(runs[1].model.state_dict())
            for k, trainer in runs.items():
                stats[k].append(trainer.train_step())
        max_grad = 0.0
        for step, (sa, sb, ga, gb) in enumerate(zip(stats[1], stats[accum], grads[1], grads[accum]), 1):
            _require(sa["items"] == sb["items"], f"{what}: update {step} counts {sa['items']:g} vs {sb['items']:g} "
                     f"items: num_items must not count padding")
            _require(_same(sb["loss"], sa["loss"], tol), f"{what}: the loss of update {step} is {sa['loss']:.6g} vs "
                     f"{sb['loss']:.6g} (difference {abs(sa['loss'] - sb['loss']):.3g}, allowed {tol:g} relative): "
                     f"the loss must be summed over exactly the num_items it counts (not averaged, no padding)")
            for name in ga.keys() | gb.keys():
                gap = _gap(gb[name], ga[name]) if name in ga and name in gb else math.inf
                max_grad = max(max_grad, gap)
                _require(gap <= tol, f"{what}: the gradient of {name} before update {step} differs {_within(gap, tol)}")
        return {"losses": [s["loss"] for s in stats[1]], "max_grad_gap": max_grad}


# -- resume ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _sigterm_after(updates: int) -> Iterator[None]:
    """SIGTERM this process right after the ``updates``-th optimizer step taken while a run's stop
    handler is installed: the run saves a checkpoint and stops, as a job a scheduler preempts."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    before, count = signal.getsignal(signal.SIGTERM), [0]

    def hook(*_):
        if signal.getsignal(signal.SIGTERM) is not before:  # inside Trainer.fit: its handler is set
            count[0] += 1
            if count[0] == updates:
                signal.raise_signal(signal.SIGTERM)

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def check_resume(recipe: str | Path, tmp_path: str | Path | None = None, overrides: Sequence[str] = (),
                 steps: int = 6, stop_after: int | None = None) -> dict[str, Any]:
    """A run of ``steps`` updates against the same run stopped by SIGTERM after ``stop_after`` (default:
    half) and continued by ``tk run --resume``: every ``metrics.jsonl`` record (losses, grad norms, task
    logs, evaluations; not the clock) and the weights (and EMA) equal, bit for bit. Randomness the engine
    does not restore (the task's own generator, state missing from ``Task.state_dict``) breaks it.
    Returns ``{"reference": the uninterrupted run dir (for check_predict, check_export), "stopped_at"}``."""
    stop_after = stop_after or steps // 2
    if not 0 < stop_after < steps:
        raise ValueError(f"stop_after={stop_after} must be between 0 and steps={steps}")
    with _isolated(tmp_path) as root:
        args = [*overrides, f"train.max_steps={steps}", "train.log_every=1"]
        reference, resumed = train_run(recipe, root / "uninterrupted", args), root / "resumed"
        with _sigterm_after(stop_after):
            stopped = _tk(["run", recipe, *QUIET, *args, f"output_dir={resumed}"], expect=None)
        _require(stopped.exit_code == 128 + signal.SIGTERM, f"the run meant to stop after update {stop_after} exited "
                 f"{stopped.exit_code} (a SIGTERM reaches only the main thread's run):\n{stopped.output.strip()}")
        stopped_at = max((r["step"] for r in _records(resumed)), default=0)
        train_run(recipe, resumed, args, flags=["--resume"])
        what = f"a run stopped after update {stop_after} and resumed vs one run of {steps} updates"
        _compare_runs(resumed, reference, 0.0, what)
        return {"reference": reference, "stopped_at": stopped_at}


# -- two processes ---------------------------------------------------------------------------------
def check_two_processes(recipe: str | Path, tmp_path: str | Path | None = None, overrides: Sequence[str] = (),
                        tol: float = 1e-5, timeout: float = 600.0) -> dict[str, Any]:
    """``tk run --nproc-per-node 2`` (torchrun; DDP over gloo with ``train.device=cpu``), batch_size B x
    grad_accum A per process, against one process of batch_size 2B x A: the same ``metrics.jsonl``
    records (losses, grad norms, evaluations merged over the ranks) and weights, within ``tol``. Slow:
    two fresh processes import torch and build the task. The task must shard its data by
    ``LoaderSpec.rank/world_size``; dropout must be off. Returns ``{"single": run dir, "two": run dir}``."""
    with _isolated(tmp_path) as root:
        cfg, _ = _config(recipe, overrides)
        b, a = cfg.train.batch_size, cfg.train.grad_accum
        single = train_run(recipe, root / "one_process", [*overrides, f"train.batch_size={2 * b}"])
        two = root / "two_processes"
        # the workers see this process's sys.path: a plugin importable here, installed or not, is there too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", "tk", "run", str(recipe), *QUIET, *overrides, f"output_dir={two}",
                               "--nproc-per-node", "2"], env=env, capture_output=True, text=True, timeout=timeout)
        _require(proc.returncode == 0, f"`tk run {recipe} --nproc-per-node 2` exited {proc.returncode}:\n"
                 f"{(proc.stdout + proc.stderr).strip()[-3000:]}")
        try:
            _compare_runs(two, single, tol, f"2 processes x batch_size {b} x grad_accum {a} vs 1 process x batch_size "
                                            f"{2 * b}")
        except AssertionError as e:
            raise AssertionError(f"{e}{_dropout_hint(load_run(single, 'last', ['train.device=cpu'])[1])}") from None
        return {"single": single, "two": two}


# -- predict and export ------------------------------------------------------------------------------
def check_predict(run_dir: str | Path, inputs: Sequence[str], overrides: Sequence[str] = (),
                  checkpoint: str = "best", tol: float = 1e-4) -> list[dict[str, Any]]:
    """``tk predict RUN_DIR INPUTS --batch-size 1 --device cpu`` prints one JSON row per input, in order,
    without errors, equal (numbers within ``tol``) to what ``Task.predict`` returns for all inputs in
    one batch in-process (``load_run``): rows that depend on their batch (padding, batch statistics, a
    reordering) or on the way through the command line fail. Returns the rows ``tk predict`` printed."""
    inputs = list(inputs)
    result = _tk(["predict", run_dir, "--batch-size", "1", "--device", "cpu", "--checkpoint", checkpoint, "--",
                  *inputs, *overrides])
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    _require([r.get("input") for r in rows] == inputs, f"tk predict printed {len(rows)} JSON rows for {len(inputs)} "
             f"inputs, for the inputs {[r.get('input') for r in rows]}, not {inputs}:\n{result.stdout}")
    failed = [r["error"] for r in rows if "error" in r]
    _require(not failed, f"tk predict failed on {len(failed)} inputs: {failed[:1]}")
    task, model = load_run(run_dir, checkpoint, [*overrides, "train.device=cpu"])
    with torch.no_grad(), Precision(task.cfg.train.precision, torch.device("cpu")).autocast():
        preds = task.predict(model, inputs)
    _require(len(preds) == len(inputs), f"{type(task).__name__}.predict: {len(preds)} rows for {len(inputs)} inputs")
    for i, (row, pred) in enumerate(zip(rows, preds)):
        direct = json.loads(format_record({"input": inputs[i], **pred}, "json"))
        _require(_same(row, direct, tol), f"input {i} ({inputs[i]!r}): tk predict (alone in its batch) gave {row}, "
                 f"{type(task).__name__}.predict on all {len(inputs)} inputs gave {direct}")
    return rows


def _flat(value: Any) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or a tuple, list or dict of them), in order."""
    value = list(value.values()) if isinstance(value, dict) else value
    if torch.is_tensor(value):
        return [value]
    return [t for v in value for t in _flat(v)] if isinstance(value, (list, tuple)) else []


def _reload(fmt: str, out: Path, task: Any, model: torch.nn.Module, tol: float) -> None:
    """Read back what ``tk export --format FMT`` wrote into ``out``; AssertionError where it differs."""
    from safetensors.torch import load_file

    if fmt == "safetensors":
        saved = load_file(out / "model.safetensors")
        state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        _require(saved.keys() == state.keys(), f"--format safetensors: other tensors: {saved.keys() ^ state.keys()}")
        for key, value in state.items():
            _require(torch.equal(saved[key], value), f"--format safetensors: {key} differs from the run's weights")
    elif fmt in ("torch-export", "onnx"):
        inputs = task.example_inputs(model)
        with torch.no_grad():
            want = _flat(model(**inputs))
            if fmt == "torch-export":
                got = _flat(torch.export.load(out / "model.pt2").module()(**inputs))
            elif importlib.util.find_spec("onnxruntime") is not None:
                import onnxruntime

                session = onnxruntime.InferenceSession(str(out / "model.onnx"))
                got = [torch.from_numpy(o) for o in session.run(None, {i.name: inputs[i.name].numpy()
                                                                       for i in session.get_inputs()})]
            else:
                got = want  # written; no runtime here to read it back
        gap = max((_gap(g, w) for g, w in zip(got, want)), default=0.0) if len(got) == len(want) else math.inf
        _require(gap <= tol, f"--format {fmt}: the reloaded model's outputs on example_inputs differ from the "
                             f"model's {_within(gap, tol)}")
    else:  # hf, timm, peft: their files read back (in their own libraries: tk's tests)
        for path in out.iterdir():
            json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else \
                load_file(path) if path.suffix == ".safetensors" else None


def check_export(run_dir: str | Path, tmp_path: str | Path | None = None, formats: Sequence[str] = EXPORT_FORMATS,
                 checkpoint: str = "best", tol: float = 1e-4) -> dict[str, str]:
    """``tk export RUN_DIR --format F`` for each of ``formats``: a format the task expresses writes and
    reloads (safetensors: the run's tensors, equal; torch-export and onnx, due where the task has
    ``example_inputs``: the reloaded graph's outputs equal the model's within ``tol``; hf, due where it
    defines ``export_hf``: its files read back); any other is refused in one ``error:`` line with exit
    code 2, never a crash (exit 1). onnx is skipped without the onnx package. Returns
    ``{format: "written" | "refused: <the line>" | "skipped: <why>"}``."""
    with _isolated(tmp_path) as root:
        task, model = load_run(run_dir, checkpoint, ["train.device=cpu"])
        model = model.float().cpu().eval()
        graph = task.example_inputs(model) is not None
        must = {"safetensors": True, "torch-export": graph, "onnx": graph,
                "hf": callable(getattr(task, "export_hf", None)) or None}  # True: written; False: refused; None: either
        report = {}
        for fmt in formats:
            if fmt == "onnx" and importlib.util.find_spec("onnx") is None:
                report[fmt] = "skipped: the onnx package is not installed"
                continue
            result = _tk(["export", run_dir, "--format", fmt, "-o", root / fmt, "--checkpoint", checkpoint], None)
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            said = f"`tk export {run_dir} --format {fmt}` exited {result.exit_code}: " + (
                " / ".join(errors) or result.output.strip())
            if result.exit_code == 0:
                _require(must.get(fmt) is not False, f"{said}; the task gives no example_inputs: it should be refused")
                _reload(fmt, root / fmt, task, model, tol)
                report[fmt] = "written"
            else:
                _require(result.exit_code == 2 and must.get(fmt) is not True, f"{said} (" + (
                    "the task expresses this format)" if must.get(fmt) else "a refusal exits 2 with one line)"))
                _require(len(errors) == 1 and "Traceback" not in result.output, f"{said}; a refusal is one line")
                report[fmt] = f"refused: {errors[0][len('error: '):]}"
        return report
