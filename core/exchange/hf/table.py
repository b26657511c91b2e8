"""The mapping a model family declares, read in both directions: config keys beside tk's
``TransformerConfig`` fields, tensor names beside tk's (with the fusions tk makes: q/k/v into one
``qkv``, gate/up into one ``fc1``; GPT-2's transposed ``Conv1D``), and what the family fixes.

A family module (``gpt2``, ``llama``, ...) builds one :class:`Family`; import
(:func:`import_state`) and export (:func:`export_state`, :func:`export_config`) read the same
object, so they cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig

KEY = "model.pretrained_from"


@dataclass(frozen=True)
class Row:
    """One tk tensor and the family tensor(s) it is made of: ``hf`` names are concatenated along
    rows (split again on export); ``transpose`` for (in, out)-stored weights (GPT-2's Conv1D)."""

    tk: str
    hf: tuple[str, ...]
    transpose: bool = False


def rows(*spec: tuple[str, str | tuple[str, ...]] | tuple[str, str | tuple[str, ...], bool]) -> tuple[Row, ...]:
    """``rows(("norm1.weight", "ln_1.weight"), ("qkv.weight", ("q.weight", "k.weight", "v.weight")), ...)``."""
    out = []
    for s in spec:
        hf = (s[1],) if isinstance(s[1], str) else tuple(s[1])
        out.append(Row(s[0], hf, bool(s[2]) if len(s) > 2 else False))
    return tuple(out)


@dataclass(frozen=True)
class Family:
    """A transformers model family as tk maps it.

    Attributes:
        name: the family ("llama").
        architectures: ``model_type`` -> the ``*ForCausalLM`` class written on export.
        plain: config key <-> ``TransformerConfig`` field pairs copied as they are both ways.
        fixed: fields the family always has (import sets them; export refuses other values).
        defaults: the config class's defaults for keys a hand-written ``config.json`` may omit.
        to_tk: the config's other keys -> (fields, problems) (biases, rope, windows, ...).
        to_hf: the inverse of ``to_tk`` for export -> (keys, problems).
        top: rows outside the layers; layer: rows of layer ``{i}``, under ``tk_layer`` / ``hf_layer``.
        ignore: name suffixes of tensors that hold no weights (GPT-2's causal-mask buffers).
        aliases: names that hold copies of the token embedding (``top``'s first row) in a tied
            model; where a file has them they must equal it (a tied head, Marian's embed_tokens).
        encoder_layer: seq2seq families: rows of encoder layer ``{i}`` under ``tk_encoder_layer`` /
            ``hf_encoder_layer`` (``layer`` is then the decoder's).
    """

    name: str
    architectures: Mapping[str, str]
    plain: tuple[tuple[str, str], ...]
    fixed: Mapping[str, Any]
    defaults: Mapping[str, Any]
    to_tk: Callable[[Mapping[str, Any]], tuple[dict[str, Any], list[str]]]
    to_hf: Callable[[TransformerConfig], tuple[dict[str, Any], list[str]]]
    top: tuple[Row, ...]
    layer: tuple[Row, ...]
    tk_layer: str = "decoder.layers.{i}."
    hf_layer: str = "model.layers.{i}."
    ignore: tuple[str, ...] = field(default=())
    aliases: tuple[str, ...] = ("lm_head.weight",)
    encoder_layer: tuple[Row, ...] = field(default=())
    tk_encoder_layer: str = "encoder.layers.{i}."
    hf_encoder_layer: str = "model.encoder.layers.{i}."

    def depths(self, cfg: TransformerConfig) -> int | tuple[int, int]:
        """The layer counts :meth:`expanded` takes for a model of ``cfg``."""
        if self.encoder_layer:
            return cfg.encoder_depth or cfg.depth, cfg.decoder_depth or cfg.depth
        return cfg.depth

    def expanded(self, depth: int | tuple[int, int]) -> list[Row]:
        """Every row with full names for a model of ``depth`` layers ((encoder, decoder) layers
        for a seq2seq family)."""
        encoder, decoder = depth if isinstance(depth, tuple) else (0, depth)
        out = list(self.top)
        for layer, tk_name, hf_name, n in ((self.encoder_layer, self.tk_encoder_layer, self.hf_encoder_layer, encoder),
                                           (self.layer, self.tk_layer, self.hf_layer, decoder)):
            for i in range(n):
                tk, hf = tk_name.format(i=i), hf_name.format(i=i)
                out += [Row(tk + r.tk, tuple(hf + n for n in r.hf), r.transpose) for r in layer]
        return out


def plain_attention_problems(cfg: TransformerConfig, family: str,
                             flags: tuple[str, ...] = ("qk_norm", "sandwich_norm")) -> list[str]:
    """What a family of plain multi-head attention with biases everywhere (GPT-2, Marian, M2M100) cannot
    express of ``cfg``: grouped-query heads, another head width, a missing bias, the decoder variants'
    options (``flags``: the true/false ones it lacks)."""
    problems = []
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        problems.append(f"model.num_kv_heads {cfg.num_kv_heads} ({family} has no grouped-query attention)")
    if cfg.head_dim not in (None, cfg.dim // cfg.num_heads):
        problems.append(f"model.head_dim {cfg.head_dim}")
    if any(b is False for b in cfg.biases()):
        problems.append(f"biases off on some layers ({family} has them everywhere)")
    for name in ("attn_scale", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types",
                 "rope_scaling"):
        if getattr(cfg, name) is not None:
            problems.append(f"model.{name} {getattr(cfg, name)}")
    return problems + [f"model.{n} true" for n in flags if getattr(cfg, n)]


def config_to_tk(family: Family, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a family ``config.json``.

    Raises:
        TkError: every option tk cannot express, in one line, before any weight is read.
    """
    values = {**family.defaults, **hf}  # an explicit null stays null (Mistral v0.2: no window)
    fields_ = dict(family.fixed)
    problems = []
    for key, name in family.plain:
        if key in values:
            fields_[name] = values[key]
    extra, more = family.to_tk(values)
    fields_.update(extra)
    problems += more
    if problems:
        raise TkError(f"{KEY}: this {values.get('model_type')} config.json has options tk does not implement: "
                      + "; ".join(problems) + " (so the model would compute something else; nothing was loaded)")
    return fields_


def export_config(family: Family, cfg: TransformerConfig, model_type: str, base: Mapping[str, Any] | None,
                  vocab_size: int) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` in the family: ``base`` (the source folder's config, so keys
    tk does not model such as token ids survive) with every mapped key set from ``cfg``.

    Raises:
        TkError: a field the family cannot express (its value and what the family needs).
    """
    for name, value in family.fixed.items():
        mine = cfg.use_final_norm if name == "final_norm" else getattr(cfg, name)
        if mine != value and name not in ("dropout", "attn_dropout", "mlp_dropout"):
            raise TkError(f"--format hf: model.{name}={mine!r} has no {family.architectures[model_type]} counterpart "
                          f"(it needs {value!r}); export --format safetensors instead")
    out = dict(base or {})
    out.update({"model_type": model_type, "architectures": [family.architectures[model_type]],
                "vocab_size": vocab_size})
    for key, name in family.plain:
        out[key] = getattr(cfg, name)
    extra, problems = family.to_hf(cfg)
    if problems:
        raise TkError(f"--format hf: the model has options {family.architectures[model_type]} cannot express: "
                      + "; ".join(problems) + "; export --format safetensors instead")
    for key, value in extra.items():  # e.g. Phi-3's partial_rotary_factor: 1.0 beside the rope keys tk writes
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _split_sizes(row: Row, t: torch.Tensor, cfg: TransformerConfig) -> list[int]:
    if len(row.hf) == 3:  # q, k, v
        kv = (cfg.num_kv_heads or cfg.num_heads) * cfg.attn_head_dim
        return [t.shape[0] - 2 * kv, kv, kv]
    return [t.shape[0] // len(row.hf)] * len(row.hf)  # gate, up


def plan_import(family: Family, files: Any, own: Mapping[str, torch.Tensor], depth: int | tuple[int, int],
                tied: bool) -> dict[str, Row]:
    """Which family tensors make each tk tensor ``own`` names, every name checked before any data
    is read (shapes are checked as each is read, :func:`read_tensor`).

    Raises:
        TkError: a tensor missing, a tensor the family does not know, or an untied head absent
            from the file, named.
    """
    table = {r.tk: r for r in family.expanded(depth)}
    plan: dict[str, Row] = {}
    for name in own:
        if tied and name == "lm_head.weight":
            continue
        row = table.get(name)
        if row is None:
            raise TkError(f"{KEY}: tk's model has a tensor {name!r} the {family.name} mapping does not name "
                          f"(a config option tk built but the family lacks)")
        missing = [n for n in row.hf if n not in files]
        if missing:
            hint = "; the config says the head is untied (tie_word_embeddings false)" if name == "lm_head.weight" else ""
            raise TkError(f"{KEY}: {files.folder} has no tensor {missing[0]!r} (needed for tk's {name}){hint}; "
                          f"is the checkpoint complete and of the family its config.json names?")
        plan[name] = row
    used = {n for row in plan.values() for n in row.hf}
    left = [n for n in files.names() if n not in used and not n.endswith(family.ignore)]
    for alias in family.aliases if tied else ():  # redundant copies of a tied embedding (Qwen1.5, old Marian files)
        if alias not in left:
            continue
        embed = family.top[0].hf[0]
        if not torch.equal(files.get(alias).to(files.file_dtype(embed)), files.get(embed)):
            raise TkError(f"{KEY}: config.json ties the embeddings (tie_word_embeddings) but the file's {alias} "
                          f"differs from {embed}; set tie_word_embeddings false in config.json or fix the file")
        left.remove(alias)
    if left:
        raise TkError(f"{KEY}: {files.folder} holds {len(left)} tensors the {family.name} mapping does not know "
                      f"({', '.join(left[:3])}); tk would drop them, so it refuses")
    return plan


def import_state(family: Family, files: Any, own: Mapping[str, torch.Tensor], depth: int | tuple[int, int], tied: bool,
                 dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tk state dict of a family checkpoint: each tk tensor ``own`` names (shapes checked),
    read from ``files`` (:class:`~tk.core.exchange.hf.folder.WeightFiles`) one at a time and cast
    to ``dtype`` (None keeps the file's).

    Raises:
        TkError: as :func:`plan_import`, or a tensor of another shape.
    """
    plan = plan_import(family, files, own, depth, tied)
    return {name: read_tensor(files, row, name, tuple(own[name].shape), dtype) for name, row in plan.items()}


def read_tensor(files: Any, row: Row, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """tk's tensor ``name`` of ``shape``: its parts read straight into their rows (a fused q/k/v or
    gate/up is never built twice), transposed through one buffer where the family stores (in, out)."""
    shapes = [files.shape(n) for n in row.hf]
    if row.transpose:
        shapes = [s[::-1] for s in shapes]
    got = (sum(s[0] for s in shapes), *shapes[0][1:]) if shapes[0] else ()
    if any(s[1:] != shapes[0][1:] for s in shapes) or got != shape:
        raise TkError(f"{KEY}: tensor {'+'.join(row.hf)} is {got if len(shapes) == 1 else shapes} but config.json "
                      f"makes tk's {name} {shape}; the weights and config.json disagree")
    kind = files.file_dtype(row.hf[0])
    out = torch.empty(shape, dtype=dtype if dtype is not None and kind.is_floating_point else kind)
    start = 0
    for part, s in zip(row.hf, shapes):
        target = out.narrow(0, start, s[0]) if out.dim() else out
        if row.transpose:
            target.copy_(files.get(part).t())
        else:
            files.read_into(part, target)
        start += s[0] if s else 0
    return out


def export_state(family: Family, sd: Mapping[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """The family's tensors of a tk state dict (the inverse of :func:`import_state`); a tied head
    (absent from ``sd``) is left out, as transformers saves it."""
    out = {}
    table = family.expanded(family.depths(cfg))
    for row in table:
        if row.tk not in sd:
            continue
        t = sd[row.tk]
        t = t.t().contiguous() if row.transpose else t
        if len(row.hf) == 1:
            out[row.hf[0]] = t
        else:
            for name, part in zip(row.hf, t.split(_split_sizes(row, t, cfg))):
                out[name] = part.contiguous()
    unmapped = [k for k in sd if k not in {r.tk for r in table}]
    if unmapped:
        raise TkError(f"--format hf: tk tensors {unmapped[:3]} have no {family.name} counterpart; export --format "
                      f"safetensors instead")
    return out
