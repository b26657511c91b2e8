"""The rotary keys of a decoder ``config.json`` both ways: transformers v5's ``rope_parameters``
and v4's top-level ``rope_theta`` + ``rope_scaling`` (hub configs still use both)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tk.core.nn.config import TransformerConfig
from tk.core.nn.rope import ROPE_TYPES, rope_scaling_problems, rope_type


def rope_to_tk(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``rope_theta`` and ``rope_scaling`` fields, and the problems of what tk cannot compute."""
    params = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):  # per layer type (Gemma 3)
        return {}, [f"rope_parameters per layer type ({', '.join(params)}) (tk has one rotary per model)"]
    theta = float(params.get("rope_theta", values.get("rope_theta", 10000.0)))
    problems = []
    partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor {partial} (tk rotates the whole head; supported: 1.0)")
    kind = rope_type(params)
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
        scaling["rope_type"] = kind
        found = rope_scaling_problems(scaling, "rope_scaling")
        if found and kind not in ROPE_TYPES:
            found = [f"rope_scaling rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})"]
        problems += found
    return {"rope_theta": theta, "rope_scaling": scaling}, problems


def rope_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    """The rotary keys of ``cfg`` in both layouts (v5 reads ``rope_parameters``, v4 the others)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    params = {"rope_type": rope_type(scaling), "rope_theta": cfg.rope_theta, **(scaling or {})}
    return {"rope_parameters": params, "rope_theta": cfg.rope_theta, "rope_scaling": scaling}
