"""LoRA: low-rank adapters on a model's ``nn.Linear`` layers, the rest frozen.

LoRA: https://arxiv.org/abs/2106.09685 ; the layout (``lora_A``/``lora_B``, Kaiming-uniform A,
zero B, ``alpha / rank`` scale, merge and unload) follows Hugging Face PEFT.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.errors import TkError

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "merge_lora", "merged_state_dict", "has_lora",
           "TARGET_ALIASES", "DEFAULT_TRAINABLE"]

# shorthands usable in ``targets``: the attention projections of every core stack (fused
# ``qkv``, or ``q_proj``/``k_proj``/``v_proj``, and the output ``proj`` of ``attn``,
# ``self_attn``, ``cross_attn``), which are also timm's ViT names; and the feed-forward layers
TARGET_ALIASES: dict[str, list[str]] = {
    "attention": ["*.qkv", "*.q_proj", "*.k_proj", "*.v_proj", "*attn.proj"],
    "mlp": ["*.fc1", "*.fc2"],
}
# the classification heads of the plugins (core ViT, timm, text classifier and its BERT pooler) stay trainable
DEFAULT_TRAINABLE = ["head", "head_dist", "classifier", "pooler"]


@dataclass
class LoRAConfig:
    """The ``model.lora:`` section: low-rank adapters on the matching ``nn.Linear`` layers."""

    rank: int = 8  # adapter rank r: each adapted layer learns B @ A with A (r, in) and B (out, r)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (the frozen layer sees x unchanged)
    targets: list[str] = field(
        default_factory=lambda: ["attention"])  # Linear layer names to adapt (fnmatch); shorthands: attention, mlp
    trainable: list[str] = field(
        default_factory=lambda: list(DEFAULT_TRAINABLE))  # module/param names (fnmatch) trained besides the adapters

    def check(self, prefix: str = "model.lora") -> list[str]:
        """Problems of this section, one line each, keys named as ``{prefix}.field``."""
        problems = []
        if self.rank < 1:
            problems.append(f"{prefix}.rank ({self.rank}) must be >= 1")
        if not self.alpha > 0:
            problems.append(f"{prefix}.alpha ({self.alpha}) must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"{prefix}.dropout ({self.dropout}) must be in [0, 1)")
        if not self.targets:
            problems.append(f"{prefix}.targets is empty; name the Linear layers to adapt, e.g. [attention]")
        return problems


class LoRALinear(nn.Linear):
    """``y = base(x) + dropout(x) @ A^T @ B^T * (alpha / rank)``.

    A subclass of ``nn.Linear`` that keeps the wrapped layer's own ``weight`` and ``bias``
    Parameters (same names in the state dict, ties kept) and adds ``lora_A`` (rank, in),
    Kaiming-uniform, and ``lora_B`` (out, rank), zeros: at initialisation the output is
    exactly the base layer's.

    Args:
        base: the layer to adapt (its parameters are reused, not copied).
        rank: r >= 1.
        alpha: scale numerator (the update is multiplied by alpha / rank).
        dropout: dropout probability on the adapter's input.
        parts: ``[(first row, rows), ...]``: row ranges of a fused layer each adapted by an
            A and B of their own (as PEFT adapts ``q_proj`` and ``v_proj``, which tk holds in
            one ``qkv``), the other rows left as they are; None: one adapter for all rows.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 parts: Sequence[tuple[int, int]] | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate and re-initialise a weight
        if rank < 1:
            raise TkError(f"model.lora.rank ({rank}) must be >= 1")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        # parts: row ranges of a fused layer adapted each on its own (PEFT's q_proj and v_proj
        # inside tk's qkv), lora_A stacked (P * rank, in), lora_B (their rows, rank)
        self.parts = [tuple(p) for p in parts] if parts is not None else None
        rows = sum(n for _, n in self.parts) if self.parts is not None else self.out_features
        a_rows = rank * (len(self.parts) if self.parts is not None else 1)
        # float32 adapters on a half-precision base (a bf16 model kept as it is): the small trained
        # part keeps full precision, as QLoRA/PEFT recipes do
        half = base.weight.dtype in (torch.bfloat16, torch.float16)
        factory = {"device": base.weight.device, "dtype": torch.float32 if half else base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(a_rows, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(rows, rank, **factory))
        for a in self.lora_A.split(rank):  # each part's A as nn.Linear initialises its own (PEFT's init)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def part_slices(self) -> list[tuple[slice, slice, slice]]:
        """Per part: its rows of the output, of ``lora_A`` and of ``lora_B``."""
        if self.parts is None:
            return [(slice(0, self.out_features), slice(0, self.rank), slice(0, self.out_features))]
        out, b = [], 0
        for p, (start, n) in enumerate(self.parts):
            out.append((slice(start, start + n), slice(p * self.rank, (p + 1) * self.rank), slice(b, b + n)))
            b += n
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out)."""
        # the scale on the (..., rank) activation and the in-place add save two full-size passes
        # (F.linear keeps its input and weight for backward, not its output, so adding into it is safe)
        a, b = self.lora_A, self.lora_B
        if a.dtype != x.dtype:  # float32 adapters beside a half-precision base
            a, b = a.to(x.dtype), b.to(x.dtype)
        z = F.linear(self.lora_dropout(x), a) * self.scale  # (..., P * rank)
        out = F.linear(x, self.weight, self.bias)
        if self.parts is None:
            return out.add_(F.linear(z, b))
        for rows, a_rows, b_rows in self.part_slices():
            out[..., rows] += F.linear(z[..., a_rows], b[b_rows])
        return out

    @torch.no_grad()
    def delta_weight(self) -> Tensor:
        """``B @ A * scale`` (out, in) (per part, in its rows), computed in float32, in the weight's dtype."""
        delta = torch.zeros(self.out_features, self.in_features, dtype=torch.float32, device=self.lora_A.device)
        for rows, a_rows, b_rows in self.part_slices():
            delta[rows] = self.lora_B[b_rows].float() @ self.lora_A[a_rows].float()
        return (delta * self.scale).to(self.weight.dtype)

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """Fold the adapter into the base weight (in place) and zero ``lora_B``, so that this
        layer computes the same function; returns a plain ``nn.Linear`` holding the same
        ``weight`` and ``bias`` Parameters (their ``requires_grad`` unchanged)."""
        self.weight.add_(self.delta_weight())
        self.lora_B.zero_()
        plain = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(plain)
        plain.in_features, plain.out_features = self.in_features, self.out_features
        plain.weight, plain.bias = self.weight, self.bias
        return plain.train(self.training)

    def extra_repr(self) -> str:
        parts = f", parts={self.parts}" if self.parts is not None else ""
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}{parts}"


# -- helpers -------------------------------------------------------------------------
def _expand(patterns: Iterable[str]) -> list[str]:
    return [p for pattern in patterns for p in TARGET_ALIASES.get(pattern, [pattern])]


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def _matches_any(names: Iterable[str], pattern: str) -> bool:
    return any(fnmatchcase(n, pattern) for n in names)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _names_within(param_name: str) -> list[str]:
    """``"a.b.weight"`` -> ``["a", "a.b", "a.b.weight"]``: the module names it lies in, and itself."""
    parts = param_name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds any :class:`LoRALinear`."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


# -- the API ---------------------------------------------------------------------------
def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: Iterable[str] = ("attention",), trainable: Iterable[str] = DEFAULT_TRAINABLE,
               names: Mapping[str, tuple[str, int, int]] | None = None) -> list[str]:
    """Replace the ``nn.Linear`` layers named by ``targets`` with :class:`LoRALinear` and
    freeze every other parameter except the adapters and those named by ``trainable``.

    Names are ``model.named_modules()`` names matched with shell-style patterns
    (``fnmatch``: ``*`` also crosses dots), e.g. ``"*.attn.qkv"``, ``"blocks.1[01].*"``;
    ``targets`` may use the shorthands of :data:`TARGET_ALIASES` ("attention", "mlp").
    A ``trainable`` pattern matches a module name (all its parameters) or a parameter name.

    A target may also name a layer as the model's source family names it (``names``, e.g. a
    Llama's ``q_proj``, matched as PEFT matches ``target_modules``: the whole name, a ``.``-suffix
    of it, or a pattern): each such layer gets an adapter of its own, also where tk fuses it
    with others (``q_proj`` and ``v_proj`` inside ``qkv``: two parts, k's rows left alone).

    Args:
        model: the model, modified in place.
        rank, alpha, dropout: see :class:`LoRALinear`.
        targets: patterns of the Linear layers to adapt.
        trainable: patterns of what else keeps training (default: classification heads).
        names: foreign layer name -> (tk Linear, its first row, rows) (see
            :func:`tk.core.exchange.hf.peft.linear_names`).

    Returns:
        The names of the adapted layers.

    Raises:
        TkError: ``rank < 1``, a model that already has LoRA, a model without ``nn.Linear``,
            targets that match no ``nn.Linear`` (naming some that exist), or a ``trainable``
            pattern of the user's (not a default one) that matches nothing.
    """
    targets, trainable = list(targets), list(trainable)
    if rank < 1:
        raise TkError(f"model.lora.rank ({rank}) must be >= 1")
    if has_lora(model):
        raise TkError(f"{type(model).__name__} already has LoRA adapters; merge_lora it first or build a fresh model")
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise TkError(f"model.lora: {type(model).__name__} has no nn.Linear layer to adapt; remove model.lora")
    within = {n for name, _ in model.named_parameters(remove_duplicate=False) for n in _names_within(name)}
    unmatched = [p for p in trainable if p not in DEFAULT_TRAINABLE and not _matches_any(within, p)]
    if unmatched:  # a typo would silently freeze what the user meant to train (e.g. a fresh head)
        tops = sorted({n.split(".")[0] for n in within})
        raise TkError(f"model.lora.trainable {unmatched} match no module or parameter of {type(model).__name__}; "
                      f"its top-level modules are {', '.join(tops[:8])}")
    patterns = _expand(targets)
    chosen: dict[str, list[tuple[int, int]] | None] = {name: None for name in linears if _matches(name, patterns)}
    for foreign, (name, start, rows) in (names or {}).items():
        if name not in chosen or chosen[name] is not None:
            if any(foreign == t or foreign.endswith("." + t) or fnmatchcase(foreign, t) for t in targets):
                chosen[name] = sorted({*(chosen.get(name) or []), (start, rows)})
    chosen = {name: chosen[name] for name in linears if name in chosen}  # the model's order
    if not chosen:
        shown = ", ".join(linears[:6]) + (f", ... ({len(linears)} in all)" if len(linears) > 6 else "")
        also = ""
        if names:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            also = f", or as its source family names them: {', '.join(leaves)}"
        raise TkError(f"model.lora.targets {targets} (patterns {patterns}) match no nn.Linear layer of "
                      f"{type(model).__name__}; its Linear layers are named e.g. {shown}{also}")
    model.requires_grad_(False)
    for name, parts in chosen.items():
        base = model.get_submodule(name)
        whole = parts is None or parts == [(0, base.out_features)]
        _set_module(model, name, LoRALinear(base, rank, alpha, dropout, None if whole else parts))
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.endswith((".lora_A", ".lora_B")) or any(_matches(n, trainable) for n in _names_within(name)):
            p.requires_grad_(True)
    return list(chosen)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain ``nn.Linear`` layers back
    (PEFT's ``merge_and_unload``), in place: the model then has the base model's structure
    and state-dict keys, and computes what base + adapters computed.

    Returns:
        ``model`` (a model without LoRA is returned unchanged).
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            plain = module.merge()
            if name:
                _set_module(model, name, plain)
            else:
                return plain
    return model


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of ``model`` with its adapters merged (``model`` itself unchanged):
    loadable by the same model built without LoRA. A model without LoRA gives its own."""
    if not has_lora(model):
        return model.state_dict()
    return merge_lora(copy.deepcopy(model)).state_dict()
