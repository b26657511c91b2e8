"""Batched prediction for ``tk predict``: reading inputs, telling overrides from inputs,
running ``Task.predict`` batch by batch with per-input errors, and formatting the records.

Every input yields exactly one record, in input order: ``{"input": ..., **prediction}``, or
``{"input": ..., "error": "one line naming the input and the problem"}`` when that input
could not be used; a bad input never costs the other inputs of its batch their prediction.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TextIO

import torch
from torch import nn

from tk.core.config import recipe_schema
from tk.core.errors import TkError
from tk.core.recipe import read_recipe
from tk.core.registry import load_task
from tk.core.text.reader import stream_lines

__all__ = ["INPUT_ERRORS", "format_record", "predict_batches", "read_inputs", "run_sections", "split_overrides"]

# Exceptions that mean "this input is unusable" (unreadable file, bad text), not a bug.
INPUT_ERRORS = (TkError, OSError, ValueError)

_OVERRIDE_RE = re.compile(r"^([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)+=")


def read_inputs(args: Iterable[str], stdin: TextIO | None = None, input_file: TextIO | None = None) -> Iterator[Any]:
    """The inputs in order: the arguments, where ``-`` stands for the lines of ``stdin`` and a
    ``.jsonl`` file for its rows (one JSON value per line: a dict for a task that takes rows,
    such as sft's prompt/completion or messages rows), then the lines of ``input_file``. One
    input per line; blank lines are skipped.

    Lines are read lazily, so predictions stream while a pipe is still being written.

    Raises:
        TkError: a ``.jsonl`` argument that is not a file, or a line of it that is not JSON.
    """
    def lines(stream: TextIO) -> Iterator[str]:  # UTF-8, or one error naming the line
        for _, line in stream_lines(stream):
            if line.strip():
                yield line

    for arg in args:
        if arg == "-":
            if stdin is None:
                raise TkError("input '-' reads standard input, but none is available")
            yield from lines(stdin)
        elif arg.endswith(".jsonl"):
            yield from _jsonl_rows(arg)
        else:
            yield arg
    if input_file is not None:
        yield from lines(input_file)


def _jsonl_rows(path: str) -> Iterator[Any]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise TkError(f"{path}: no such file; a .jsonl input is read as one input per line (a JSON value each)")
    with file.open("rb") as f:
        for n, line in stream_lines(f, path):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise TkError(f"{path} line {n}: not JSON ({e.msg}, column {e.colno}); give one JSON value per "
                              f"line") from None


def run_sections(run_dir: str | Path) -> list[str]:
    """The config section names of a run (its task's sections and core's), from its
    ``config.yaml``; just core's when the run dir has none (loading it then says why)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return ["optim", "schedule", "train"]
    task = read_recipe(path).get("task")
    schema = recipe_schema(load_task(task)) if isinstance(task, str) else {}
    return [name for name in schema if name not in ("task", "output_dir")] or ["optim", "schedule", "train"]


def split_overrides(args: Sequence[str], sections: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split command-line arguments into config overrides and inputs.

    An argument ``section.key=value`` whose ``section`` is one of the run's config sections
    (``predict.top_k=3``, ``train.device=cpu``) is an override; any other argument is an
    input. An input that would read as an override can come through stdin or ``--input-file``.

    Returns:
        ``(overrides, inputs)``, each in the order given.
    """
    names = set(sections)
    overrides, inputs = [], []
    for arg in args:
        match = _OVERRIDE_RE.match(arg)
        (overrides if match and match.group(1) in names else inputs).append(arg)
    return overrides, inputs


def _label(item: Any) -> str:
    """An input as error messages name it: itself, or a row (a .jsonl line) as its JSON text, cut."""
    if isinstance(item, str):
        return item
    text = json.dumps(item, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(message: str, item: Any) -> str:
    message, label = " ".join(str(message).split()), _label(item)
    return message if label in message else f"{label}: {message}"


def _record(item: Any, pred: Any) -> dict[str, Any]:
    if not isinstance(pred, dict):
        raise TkError(f"Task.predict must return one dict per input, got {type(pred).__name__} for {_label(item)!r}")
    rest = {k: v for k, v in pred.items() if k != "input"}
    if "error" in rest:
        rest["error"] = _one_line(rest["error"], item)
    return {"input": item, **rest}


def _predict_batch(task: Any, model: nn.Module, batch: list[Any], autocast) -> list[dict[str, Any]]:
    row = next((item for item in batch if not isinstance(item, str)), None)
    if row is not None and not getattr(task, "predict_rows", False):
        raise TkError(f"task {task.name!r} predicts from text; the rows of a .jsonl input ({_label(row)}) go only to "
                      f"tasks that read rows (sft); give the text itself, one input per line of a plain file")
    try:
        with torch.no_grad(), autocast():
            preds = task.predict(model, batch)
    except INPUT_ERRORS as e:
        if len(batch) == 1:
            return [{"input": batch[0], "error": _one_line(e, batch[0])}]
        # isolate the bad input(s): the others still get their prediction
        return [r for item in batch for r in _predict_batch(task, model, [item], autocast)]
    if len(preds) != len(batch):
        raise TkError(f"{type(task).__name__}.predict returned {len(preds)} results for {len(batch)} inputs; "
                      f"it must return one dict per input, in order")
    return [_record(item, pred) for item, pred in zip(batch, preds)]


def predict_batches(task: Any, model: nn.Module, inputs: Iterable[Any], batch_size: int = 32,
                    autocast=contextlib.nullcontext) -> Iterator[dict[str, Any]]:
    """Records for ``inputs``, computed ``batch_size`` at a time and yielded as each batch ends.

    Args:
        task: the run's task (its ``predict(model, inputs)`` gives one dict per input).
        model: the model, in eval mode, on its device.
        inputs: raw inputs (paths, sentences, rows of a .jsonl file); may be a lazy iterator.
        batch_size: inputs per ``Task.predict`` call.
        autocast: a context-manager factory for the forward pass (the run's precision).

    Yields:
        ``{"input": item, **prediction}`` or ``{"input": item, "error": "..."}`` per input, in order.

    Raises:
        TkError: ``batch_size`` < 1, or ``predict`` broke its contract (wrong count or type).
    """
    if batch_size < 1:
        raise TkError(f"--batch-size must be >= 1, got {batch_size}")
    it = iter(inputs)
    while batch := list(itertools.islice(it, batch_size)):
        yield from _predict_batch(task, model, batch, autocast)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    return str(value)


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and all(isinstance(v, dict) and "label" in v for v in value):
        # ranked candidates, e.g. [{"label": "cat", "prob": 0.91}, ...] -> "cat 0.910, ..."
        score = next((k for k in ("prob", "score") if k in value[0]), None)
        return ", ".join(f"{v['label']} {v[score]:.3f}" if score else str(v["label"]) for v in value)
    return json.dumps(value, default=_jsonable)


def format_record(record: dict[str, Any], fmt: str = "json") -> str:
    """One output line: a JSON object (``fmt="json"``) or ``input: prediction`` for people.

    In text, one field prints as its value alone (``cat.png: cat 0.910, dog 0.050``);
    several print as ``key=value`` pairs; an error as ``input: error: message``.
    """
    if fmt == "json":
        return json.dumps(record, default=_jsonable)
    fields = {k: v for k, v in record.items() if k != "input"}
    head = record["input"] if isinstance(record["input"], str) else json.dumps(record["input"], default=_jsonable)
    if "error" in fields:
        return f"{head}: error: {fields['error']}"
    if len(fields) == 1:
        return f"{head}: {_text_value(next(iter(fields.values())))}"
    return f"{head}: " + "  ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
