"""The model card (``README.md``) written beside exported weights: a YAML front matter block
that the Hugging Face hub reads (``huggingface_hub.ModelCard``: library, pipeline, tags, the
pretrained source as ``base_model``, datasets, and the checkpoint's metrics as a
``model-index``), then the task, checkpoint, metrics, how to load it and the resolved recipe."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

import tk
from tk.core.exchange.hf.bert import is_hub_id

__all__ = ["model_card", "front_matter"]

LIBRARIES = {"hf": "transformers", "timm": "timm", "onnx": "onnx"}
PIPELINES = {"text_classification": "text-classification", "image_classification": "image-classification",
             "language_model": "text-generation", "mlm": "fill-mask", "translation": "translation"}


def _base_model(model: Any) -> str | None:
    """The hub id the run started from: an HF ``model.pretrained_from`` or a pretrained timm model."""
    source = getattr(model, "pretrained_from", None)
    if isinstance(source, str) and is_hub_id(source):
        return source
    timm_name = getattr(model, "timm", None)
    if timm_name and getattr(model, "pretrained", False):
        return f"timm/{timm_name}"
    return None


# datasets' packaged builders: a local file's format, never a hub dataset id
_BUILDERS = {"parquet", "json", "csv", "text", "arrow", "imagefolder", "audiofolder", "webdataset", "pandas"}


def _hub_dataset(name: Any) -> str | None:
    """``data.hf_name`` where it names a hub dataset (not a local path, a saved folder or a builder)."""
    if not isinstance(name, str) or name in _BUILDERS or Path(name).expanduser().exists() or not is_hub_id(name):
        return None
    return name


def front_matter(task: Any, fmt: str, metrics: dict[str, float], license: str | None = None,
                 name: str | None = None) -> dict[str, Any]:
    """The card's metadata (``huggingface_hub.ModelCardData`` fields): ``license`` as given, the
    ``model-index`` entry named ``name`` (the run's folder), datasets only where they are hub ids."""
    model, data = task.cfg.sections.get("model"), task.cfg.sections.get("data")
    pipeline = PIPELINES.get(task.name)
    meta: dict[str, Any] = {"license": license, "library_name": LIBRARIES.get(fmt), "pipeline_tag": pipeline,
                            "tags": ["tk", task.name, fmt], "base_model": _base_model(model)}
    hf_name = _hub_dataset(getattr(data, "hf_name", None)) if getattr(data, "source", None) == "hf" else None
    if hf_name:
        meta["datasets"] = [hf_name]
    if metrics:
        dataset = {"name": hf_name or f"{getattr(data, 'source', 'data')} (val)", "type": hf_name or task.name}
        meta["model-index"] = [{"name": name or task.name, "results": [{
            "task": {"type": pipeline or task.name}, "dataset": dataset,
            "metrics": [{"type": k.split("/")[-1], "name": k, "value": float(v)} for k, v in sorted(metrics.items())],
        }]}]
    return {k: v for k, v in meta.items() if v is not None}


def model_card(task: Any, fmt: str, source: dict[str, Any], metrics: dict[str, float], files: list[str],
               how: str) -> str:
    """The ``README.md`` written beside exported weights (front matter first)."""
    cfg = task.cfg
    recipe = cfg.to_yaml().rstrip()
    metric_lines = "\n".join(f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())) or "| (none logged) | |"
    section = cfg.sections["data"]
    data = json.dumps(dataclasses.asdict(section) if dataclasses.is_dataclass(section) else str(section), default=str)
    weights = "EMA" if source["ema"] else "raw"
    lora = getattr(cfg.sections.get("model"), "lora", None)
    lora_line = (f"- LoRA: the rank-{lora.rank} adapters are merged into their base weights (no adapter tensors; "
                 f"the model built without `model.lora`)\n" if lora is not None else "")
    header = yaml.safe_dump(front_matter(task, fmt, metrics, source.get("license"), source.get("name")),
                            sort_keys=False)
    return (f"---\n{header}---\n\n# {task.name}: exported with tk\n\n"
            f"- task: `{task.name}`\n- format: `{fmt}` ({', '.join(files)})\n"
            f"- checkpoint: `{Path(source['checkpoint']).name}`, step {source['step']}, {weights} weights"
            + (f" ({source['note']})" if source.get("note") else "") + "\n"
            f"{lora_line}- tk version: {tk.__version__}\n- data: `{data}`\n\n"
            f"## Metrics of this checkpoint\n\n| metric | value |\n|---|---|\n{metric_lines}\n\n"
            f"## How to load\n\n{how}\n\n## Recipe (resolved config)\n\n```yaml\n{recipe}\n```\n")
