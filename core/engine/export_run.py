"""``tk export``: a finished run's model in another format, with a model card beside it.

Formats: ``safetensors`` (the state dict + the task files), ``hf`` (a transformers folder,
:mod:`tk.core.exchange.export_hf`), ``peft`` (a LoRA run's adapters as PEFT's folder,
:mod:`tk.core.exchange.hf.peft`), ``timm`` (:mod:`tk.core.exchange.export_timm`),
``torch-export`` (a ``.pt2`` program) and ``onnx`` (:mod:`tk.core.exchange.export_graph`).
Everything is written into a temporary sibling folder first and renamed into place at the
end, so a failed export leaves nothing behind (:mod:`tk.core.run.outputs`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from tk.core.engine.inference import load_run_source
from tk.core.errors import TkError
from tk.core.exchange.card import model_card
from tk.core.exchange.export import export_safetensors, tk_metadata
from tk.core.exchange.export_graph import example_inputs, export_onnx, export_program
from tk.core.exchange.export_hf import HF_SOURCE_CONFIG, KEPT_FILES, hf_export, peft_export, write_hf_folder
from tk.core.exchange.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tk.core.exchange.export_timm import timm_export, timm_hub_config, timm_load_code
from tk.core.nn.lora import merge_lora
from tk.core.run.loggers import read_records
from tk.core.run.outputs import OUTPUT_MARKER, check_output, write_output_folder

__all__ = ["FORMATS", "export_run", "checkpoint_metrics"]

FORMATS = ("hf", "peft", "timm", "safetensors", "torch-export", "onnx")


def checkpoint_metrics(run_dir: Path, step: int | None) -> dict[str, float]:
    """The evaluation metrics ``metrics.jsonl`` holds for ``step`` (the last record wins)."""
    found: dict[str, float] = {}
    for record in read_records(run_dir / "metrics.jsonl"):
        if step is not None and record.get("step") == step and record.get("split") != "train":
            found.update({k: v for k, v in record.items() if "/" in k and isinstance(v, (int, float))})
    return found


def _safetensors(run_dir: Path, task: Any, model: torch.nn.Module, out: Path,
                 meta: dict[str, str]) -> tuple[list[str], str]:
    export_safetensors(model, out / "model.safetensors", metadata=meta)
    files = ["model.safetensors"] + (["artifacts/"] if task.files.copy_to(out) else [])
    how = ("```python\nfrom safetensors.torch import load_file\nstate = load_file('model.safetensors')\n```\n"
           f"or with tk: `tk predict {run_dir} --weights model.safetensors INPUT...`")
    return files, how


def _hf(run_dir: Path, task: Any, model: torch.nn.Module, out: Path,
        meta: dict[str, str]) -> tuple[list[str], str]:
    config, state = hf_export(task, model)
    tokenizer = task.files.read_text("tokenizer.json") if task.files.exists("tokenizer.json") else None
    if tokenizer is not None and '"model"' not in tokenizer:  # an old char table, not a tokenizers file
        tokenizer = None
    max_len = config.get("max_position_embeddings") or config.get("n_positions")
    kept = {n: task.files.path(n).read_bytes() for n in KEPT_FILES if task.files.exists(n)} \
        if task.files.exists(HF_SOURCE_CONFIG) else None
    files = write_hf_folder(out, config, state, tokenizer, max_len, meta, kept)
    arch = config["architectures"][0]
    auto = "AutoModelForSequenceClassification" if "SequenceClassification" in arch else \
        "AutoModelForMaskedLM" if "MaskedLM" in arch else \
        "AutoModelForSeq2SeqLM" if config.get("is_encoder_decoder") else "AutoModelForCausalLM"
    how = (f"```python\nfrom transformers import AutoTokenizer, {auto}\n"
           f"model = {auto}.from_pretrained('PATH')  # {config['architectures'][0]}\n"
           + ("tokenizer = AutoTokenizer.from_pretrained('PATH')\n" if tokenizer or "vocab.json" in files else "")
           + "```")
    return files, how


def _peft(run_dir: Path, task: Any, model: torch.nn.Module, out: Path,
          meta: dict[str, str]) -> tuple[list[str], str]:
    config, tensors = peft_export(task, model)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    export_safetensors(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt", **meta})
    auto = "AutoModelForSeq2SeqLM" if config["task_type"] == "SEQ_2_SEQ_LM" else "AutoModelForCausalLM"
    how = (f"```python\nfrom peft import PeftModel\nfrom transformers import {auto}\n"
           f"base = {auto}.from_pretrained({config['base_model_name_or_path']!r})\n"
           "model = PeftModel.from_pretrained(base, 'PATH')  # model.merge_and_unload() folds it in\n```\n"
           f"or with tk: `model: {{pretrained_from: {config['base_model_name_or_path']}, adapter_from: PATH}}`")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS], how


def _timm(run_dir: Path, task: Any, model: torch.nn.Module, out: Path,
          meta: dict[str, str]) -> tuple[list[str], str]:
    name, kwargs, state = timm_export(task, model)
    export_safetensors(state, out / "model.safetensors", metadata=meta)
    (out / "timm_model.json").write_text(json.dumps({"model_name": name, "kwargs": kwargs}, indent=2) + "\n",
                                         encoding="utf-8")
    img_size = kwargs.get("img_size") or task.data.img_size
    config = timm_hub_config(name, kwargs, img_size, task.data_config, getattr(task, "class_names", None))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    how = ("```python\nimport timm\nmodel = timm.create_model('local-dir:PATH', pretrained=True).eval()"
           "  # or 'hf-hub:USER/REPO' once pushed\n"
           "# the run's input pipeline (size, mean/std, interpolation, crop_pct):\n"
           "transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))\n"
           f"# without config.json: {timm_load_code(name, kwargs)}\n```")
    return ["config.json", "model.safetensors", "timm_model.json"], how


def _program(run_dir: Path, task: Any, model: torch.nn.Module, out: Path,
             meta: dict[str, str]) -> tuple[list[str], str]:
    inputs = example_inputs(task, model)
    torch.export.save(export_program(model, inputs), out / "model.pt2")
    how = (f"```python\nimport torch\nprogram = torch.export.load('model.pt2')\n"
           f"outputs = program.module()({', '.join(f'{k}=...' for k in inputs)})\n```")
    return ["model.pt2"], how


def _onnx(run_dir: Path, task: Any, model: torch.nn.Module, out: Path,
          meta: dict[str, str]) -> tuple[list[str], str]:
    inputs = example_inputs(task, model)
    export_onnx(model, inputs, out / "model.onnx")
    how = (f"```python\nimport onnxruntime\nsession = onnxruntime.InferenceSession('model.onnx')\n"
           f"outputs = session.run(None, {{{', '.join(f'{k!r}: ...' for k in inputs)}}})\n```")
    return ["model.onnx"], how


_WRITERS: dict[str, Callable[..., tuple[list[str], str]]] = {
    "safetensors": _safetensors, "hf": _hf, "peft": _peft, "timm": _timm, "torch-export": _program, "onnx": _onnx}


def checkpoint_note(run_dir: Path, checkpoint: str, source: dict[str, Any]) -> str:
    """What a user must know about the weights exported: an unfinished run, and ``best`` taken
    from ``last.pt`` (no best checkpoint): said in the command's line and the card, never silent."""
    notes = []
    try:
        status = json.loads((run_dir / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        status = {}
    if status.get("status") not in (None, "finished"):
        notes.append(f"the run is unfinished: {status['status']} at step {status.get('step')} of "
                     f"{status.get('total_steps', '?')}")
    if checkpoint == "best" and Path(source["checkpoint"]).name == "last.pt":
        notes.append("no best.pt (no train.best_metric, or no evaluation yet): its last checkpoint instead")
    return "; ".join(notes)


def export_run(run_dir: str | Path, fmt: str, output: str | Path | None = None, checkpoint: str = "best",
               ema: bool | None = None, overwrite: bool = False, overrides: list[str] = (),
               license: str | None = None) -> dict[str, Any]:
    """``tk export``: write the run's model in ``fmt`` into ``output`` (default
    ``<run_dir>/export/<fmt>``) with a model card ``README.md``.

    Args:
        run_dir: a directory written by ``tk run``.
        fmt: one of :data:`FORMATS`.
        output: the folder to write (see :func:`~tk.core.run.outputs.check_output`: an
            existing one is replaced only with ``overwrite`` and only when ``tk export``
            wrote it; never a run dir, a run's checkpoints, the current folder or a folder
            holding the run).
        checkpoint, ema, overrides: which weights, as for ``tk eval`` (see ``load_run``).
        license: the model card's license id (``apache-2.0``); None: none stated.

    Returns:
        ``{"output", "format", "files", "checkpoint", "step", "ema"}``.

    Raises:
        TkError: an unknown format, an existing output, a model the format cannot express
            (naming the config key), or a failed trace; nothing is written then.
    """
    if fmt not in _WRITERS:
        raise TkError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    reading = [run_dir] + ([Path(checkpoint)] if checkpoint not in ("best", "last") else [])
    out = check_output(output if output is not None else run_dir / "export" / fmt, "tk export", overwrite,
                       sources=reading, folder=True)
    task, model, source = load_run_source(run_dir, checkpoint, list(overrides), ema=ema)
    source["note"] = checkpoint_note(run_dir, checkpoint, source)
    source["license"], source["name"] = license, run_dir.resolve().name
    # portable weights: float32 on the CPU, LoRA adapters folded into their base weights, so
    # every format holds the plain model (its library knows no adapters), except PEFT's: the adapters
    model = model.float().cpu().eval()
    model = model if fmt == "peft" else merge_lora(model)

    def fill(tmp: Path) -> None:
        meta = tk_metadata(task.name, source["step"], tk_export_format=fmt)
        files, how = _WRITERS[fmt](run_dir, task, model, tmp, meta)
        metrics = checkpoint_metrics(run_dir, source["step"])
        (tmp / "README.md").write_text(model_card(task, fmt, source, metrics, files, how), encoding="utf-8")

    write_output_folder(out, "tk export", fill, {"format": fmt, "run": str(run_dir.resolve()), "step": source["step"]})
    files = sorted(p.name for p in out.iterdir() if p.name != OUTPUT_MARKER)
    return {"output": str(out), "format": fmt, "files": files,
            **{k: v for k, v in source.items() if k not in ("license", "name")}}
