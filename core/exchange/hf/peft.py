"""PEFT LoRA adapters in and out of tk: the folder ``PeftModel.from_pretrained(base, folder)`` loads
(``adapter_config.json`` + ``adapter_model.safetensors``), written from a tk LoRA run on a Hugging
Face decoder, and read as the starting point of a run.

Names come from the family's one table (:mod:`tk.core.exchange.hf.table`): each transformers
``nn.Linear`` (``model.layers.0.self_attn.q_proj``) is a row range of a tk Linear (the q rows of
``decoder.layers.0.self_attn.qkv``). A tk adapter on a fused layer is split exactly: ``lora_B`` by
rows, ``lora_A`` copied to each part (``B_q A = (B A)[q rows]``); an adapter of the family's own
names (``model.lora.targets: [q_proj, v_proj]``) has one A and B per part already. Keys are
``base_model.model.<layer>.lora_{A,B}.weight``, trained whole modules ``base_model.model.<layer>.weight``
(``modules_to_save``). GPT-2's ``Conv1D`` layers need ``fan_in_fan_out``; its adapters' shapes are
the same.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.core.errors import TkError
from tk.core.exchange.hf.table import Family, _split_sizes, export_state
from tk.core.nn.config import TransformerConfig
from tk.core.nn.lora import LoRAConfig, LoRALinear

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "linear_names", "export_adapter", "read_adapter", "adapter_lora",
           "load_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
KEY = "model.adapter_from"
log = logging.getLogger(__name__)

Names = Mapping[str, tuple[str, int, int]]  # family Linear -> (tk Linear, first row, rows)


def linear_names(family: Family, model: nn.Module, cfg: TransformerConfig) -> dict[str, tuple[str, int, int]]:
    """Every ``nn.Linear`` of the family's model (its module name inside ``*ForCausalLM``) as the
    rows of a tk Linear of ``model``: ``{"model.layers.0.self_attn.k_proj": ("decoder.layers.0.self_attn.qkv",
    64, 32), ...}``."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    out = {}
    for row in family.expanded(family.depths(cfg)):
        module = row.tk.removesuffix(".weight")
        if module == row.tk or module not in linears:
            continue
        sizes = _split_sizes(row, linears[module].weight, cfg) if len(row.hf) > 1 else [linears[module].out_features]
        start = 0
        for hf, n in zip(row.hf, sizes):
            out[hf.removesuffix(".weight")] = (module, start, n)
            start += n
    return out


def _by_tk(names: Names) -> dict[str, list[tuple[str, int, int]]]:
    """tk Linear -> its family layers ``(name, first row, rows)`` in row order."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for hf, (module, start, n) in names.items():
        out.setdefault(module, []).append((hf, start, n))
    return {k: sorted(v, key=lambda x: x[1]) for k, v in out.items()}


def _parts(module: LoRALinear, name: str, layers: list[tuple[str, int, int]]):
    """Per family layer of a LoRA layer: (its name, rows of lora_A, rows of lora_B)."""
    for rows, a_rows, b_rows in module.part_slices():
        inside = [(hf, s, n) for hf, s, n in layers if s >= rows.start and s + n <= rows.stop]
        if sum(n for _, _, n in inside) != rows.stop - rows.start:
            raise TkError(f"--format peft: tk's adapter on {name} rows {rows.start}..{rows.stop} covers no whole "
                          f"layer of the family; export --format hf (merged) instead")
        for hf, s, n in inside:
            first = b_rows.start + s - rows.start
            yield hf, a_rows, slice(first, first + n)


def export_adapter(model: nn.Module, names: Names, family: Family, cfg: TransformerConfig, lora: LoRAConfig,
                   base: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config.json, tensors)`` of the LoRA layers of ``model`` (not merged).

    Raises:
        TkError: a model without adapters, an adapter or a trained tensor PEFT cannot name.
    """
    layers = _by_tk(names)
    tensors: dict[str, torch.Tensor] = {}
    adapted: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        if name not in layers:
            raise TkError(f"--format peft: the adapter on tk's {name} has no {family.name} counterpart; export "
                          f"--format hf (merged) instead")
        for hf, a_rows, b_rows in _parts(module, name, layers[name]):
            tensors[f"{PREFIX}{hf}.lora_A.weight"] = module.lora_A[a_rows].detach().to(torch.float32, copy=True).contiguous()
            tensors[f"{PREFIX}{hf}.lora_B.weight"] = module.lora_B[b_rows].detach().to(torch.float32, copy=True).contiguous()
            adapted.append(hf)
    if not adapted:
        raise TkError("--format peft: the run has no LoRA adapters (model.lora); export the whole model with "
                      "--format hf")
    saved, more = _modules_to_save(model, family, cfg)
    tensors.update(more)
    leaves = sorted({hf.rsplit(".", 1)[-1] for hf in adapted})
    # short names where they pick exactly the adapted layers (as people write them), else the full names
    same = {hf for hf in names if hf.rsplit(".", 1)[-1] in leaves} == set(adapted)
    task_type = "SEQ_2_SEQ_LM" if family.encoder_layer else "CAUSAL_LM"  # a translator's, or a decoder's
    config = {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "fan_in_fan_out": family.name == "gpt2", "target_modules": leaves if same else sorted(adapted),
              "modules_to_save": saved or None, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "inference_mode": True}
    return config, tensors


def _modules_to_save(model: nn.Module, family: Family, cfg: TransformerConfig
                     ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """What trains besides the adapters (``model.lora.trainable``) as PEFT's ``modules_to_save``:
    every tensor of each such family module (PEFT replaces the module whole)."""
    trained = [n for n, p in model.named_parameters() if p.requires_grad and not n.endswith((".lora_A", ".lora_B"))]
    if not trained:
        return [], {}
    embed = "src_embed" if hasattr(model, "src_embed") else "tok_embed"  # a translator's shared embedding
    tied = model.lm_head.weight is getattr(model, embed).weight
    if tied and {"lm_head.weight", f"{embed}.weight", "tgt_embed.weight"} & set(trained):
        raise TkError("--format peft: the trained embedding is tied to the head; PEFT's modules_to_save cannot hold "
                      "a tied pair; export --format hf (merged) instead")
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}
    if tied:  # a tied head (and a shared target embedding) is the embedding's tensor
        sd.pop("lm_head.weight", None)
        sd.pop("tgt_embed.weight", None)
    rows = {r.tk: r for r in family.expanded(family.depths(cfg))}
    modules = set()
    for name in trained:
        row = rows.get(name)
        if row is None or len(row.hf) != 1:
            raise TkError(f"--format peft: tk's trained {name} is no single {family.name} tensor (PEFT's "
                          f"modules_to_save); export --format hf (merged) instead")
        modules.add(row.hf[0].rsplit(".", 1)[0])
    full = export_state(family, sd, cfg)
    tensors = {PREFIX + k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in full.items() if k.rsplit(".", 1)[0] in modules}
    return sorted({m.rsplit(".", 1)[-1] for m in modules}), tensors


# -- reading an adapter ---------------------------------------------------------------
def read_adapter(folder: str | Path) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA folder, checked for what tk can express.

    Raises:
        TkError: no such folder or file, another PEFT method, options tk does not implement.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise TkError(f"{KEY}: {folder} is not a folder; give a PEFT adapter folder (adapter_config.json + "
                      f"adapter_model.safetensors, as PeftModel.save_pretrained writes it)")
    if not (path / ADAPTER_CONFIG).is_file():
        raise TkError(f"{KEY}: {folder} has no {ADAPTER_CONFIG}; it is not a PEFT adapter folder")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TkError(f"{KEY}: cannot read {path / ADAPTER_CONFIG}: {e}") from e
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (tk reads LORA)")
    if config.get("task_type") not in (None, "CAUSAL_LM", "SEQ_2_SEQ_LM"):
        problems.append(f"task_type {config.get('task_type')!r} (tk reads CAUSAL_LM and SEQ_2_SEQ_LM adapters)")
    for key, ok in (("use_dora", False), ("bias", "none"), ("rank_pattern", {}), ("alpha_pattern", {}),
                    ("layers_to_transform", None), ("layers_pattern", None), ("exclude_modules", None),
                    ("lora_bias", False), ("target_parameters", None), ("trainable_token_indices", None),
                    ("layer_replication", None), ("use_qalora", False)):
        if config.get(key, ok) not in (ok, None, [], {}) and not (key == "bias" and config.get(key) == "none"):
            problems.append(f"{key} {config[key]!r}")
    if problems:
        raise TkError(f"{KEY}: {folder} has options tk does not implement: {'; '.join(problems)}")
    if not any((path / n).is_file() for n in (ADAPTER_WEIGHTS, "adapter_model.bin")):
        raise TkError(f"{KEY}: {folder} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; copy the whole adapter folder")
    return config


def adapter_lora(config: Mapping[str, Any], names: Names, family: Family, cfg: TransformerConfig) -> LoRAConfig:
    """The ``model.lora`` section an adapter's config means: rank, alpha, dropout, its target layers
    by their family names, its ``modules_to_save`` as tk's trained modules.

    Raises:
        TkError: a module to save that the family's table does not name.
    """
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", 8))
    if config.get("use_rslora"):  # rank-stabilised: alpha / sqrt(r); tk scales by alpha / r
        alpha *= math.sqrt(r)
    targets = config.get("target_modules") or []
    if targets == "all-linear":  # PEFT's shorthand: every Linear but the output layer
        targets = sorted(n for n in names if n != "lm_head")
    elif isinstance(targets, str):  # a regular expression over the full names
        targets = sorted(n for n in names if re.fullmatch(targets, n))
    if not targets:
        raise TkError(f"{KEY}: the adapter's target_modules {config.get('target_modules')!r} name no layer of this "
                      f"{family.name} model; it was made for another model")
    modules = {r_.hf[0].rsplit(".", 1)[0]: r_.tk.rsplit(".", 1)[0] for r_ in family.expanded(family.depths(cfg))
               if len(r_.hf) == 1}
    trainable = []
    for saved in config.get("modules_to_save") or []:
        found = sorted({tk for hf, tk in modules.items() if hf == saved or hf.endswith("." + saved)})
        if not found:
            raise TkError(f"{KEY}: the adapter's modules_to_save {saved!r} names no {family.name} module tk maps")
        trainable += found
    return LoRAConfig(rank=r, alpha=alpha, dropout=float(config.get("lora_dropout", 0.0)), targets=list(targets),
                      trainable=trainable)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / ADAPTER_WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / ADAPTER_WEIGHTS))
    return torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)


@torch.no_grad()
def load_adapter(model: nn.Module, names: Names, family: Family, cfg: TransformerConfig, folder: str | Path,
                 base: str | None) -> int:
    """Copy a PEFT adapter's tensors into the LoRA layers of ``model`` (built by ``apply_lora``
    from :func:`adapter_lora`), and its ``modules_to_save`` into the model; returns the tensors read.

    Raises:
        TkError: a tensor of another shape (the adapter of another model), one missing, one the
            model has no place for.
    """
    folder = Path(folder).expanduser()
    weights = {k.replace(".default.", "."): v for k, v in _read_weights(folder).items()}
    which = f"the adapter in {folder} (base model {base!r})"
    layers = _by_tk(names)
    used = set()

    def put(key: str, target: torch.Tensor, transpose: bool = False) -> None:
        if key not in weights:
            raise TkError(f"{KEY}: {which} has no tensor {key!r}; it does not fit this model")
        value = weights[key].t() if transpose else weights[key]
        if tuple(value.shape) != tuple(target.shape):
            raise TkError(f"{KEY}: {which}: {key} is {tuple(weights[key].shape)} but this model needs "
                          f"{tuple(target.shape)}; the adapter was trained on another model")
        target.copy_(value)
        used.add(key)

    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for hf, a_rows, b_rows in _parts(module, name, layers.get(name, [])):
                put(f"{PREFIX}{hf}.lora_A.weight", module.lora_A[a_rows])
                put(f"{PREFIX}{hf}.lora_B.weight", module.lora_B[b_rows])
    rows = {r.hf[0]: r for r in family.expanded(family.depths(cfg)) if len(r.hf) == 1}
    own = dict(model.named_parameters(remove_duplicate=False))
    for key in [k for k in weights if k not in used and not k.endswith((".lora_A.weight", ".lora_B.weight"))]:
        row = rows.get(key.removeprefix(PREFIX))  # a modules_to_save tensor
        if row is not None and row.tk in own:
            put(key, own[row.tk], row.transpose)
    left = sorted(set(weights) - used)
    if left:
        raise TkError(f"{KEY}: {which} holds {len(left)} tensors this model has no adapter for ({', '.join(left[:3])});"
                      f" its target_modules do not match the run's model")
    return len(used)
