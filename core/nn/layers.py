"""Small Transformer layers: the feed-forward Mlp (GELU/ReLU/SiLU, gated SwiGLU/GeGLU), DropPath, RMSNorm.

Papers: SwiGLU, "GLU Variants Improve Transformer" (Shazeer, 2020), https://arxiv.org/abs/2002.05202;
stochastic depth, "Deep Networks with Stochastic Depth" (Huang et al., 2016),
https://arxiv.org/abs/1603.09382; RMSNorm (Zhang & Sennrich, 2019), https://arxiv.org/abs/1910.07467.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tk.core.nn.config import ACTIVATIONS, GATED_ACTIVATIONS, NORMS


class SwiGLUAct(nn.Module):
    """SwiGLU gate on a packed input: (..., 2 * hidden) -> (..., hidden) = silu(gate) * value.

    The first half of the last dim is the gate, the second half the value.
    """

    def forward(self, x: Tensor) -> Tensor:
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value


class GeGLUAct(nn.Module):
    """GeGLU gate on a packed input: gelu(gate) * value, exact or tanh-approximated GELU
    (Gemma's ``gelu_pytorch_tanh``); halves as :class:`SwiGLUAct`."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        gate, value = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * value


def build_activation(name: str) -> nn.Module:
    """The module of an ``ACTIVATIONS`` name (gated ones take the packed ``[gate; value]``)."""
    return {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU, "silu": nn.SiLU,
            "swiglu": SwiGLUAct, "geglu": GeGLUAct, "geglu_tanh": lambda: GeGLUAct("tanh")}[name]()


class Mlp(nn.Module):
    """Position-wise feed-forward network: fc1 -> act -> dropout -> fc2 -> proj_dropout.

    Parameter names follow timm's ``Mlp`` (``fc1``, ``act``, ``fc2``), so timm ViT weights
    load directly. For ``activation="swiglu"``, ``fc1`` is packed: ``fc1`` maps D -> 2 *
    hidden_dim; rows ``[:hidden_dim]`` are the gate (LLaMA's ``w1``, timm SwiGLU's
    ``fc1_g``) and rows ``[hidden_dim:]`` the value (LLaMA's ``w3``, timm's ``fc1_x``);
    ``fc2`` is LLaMA's ``w2``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
        out_dim: int | None = None,
        proj_dropout: float | None = None,
    ) -> None:
        """Args:
            dim: input width D.
            hidden_dim: hidden width (for SwiGLU, the width after gating).
            activation: one of ``ACTIVATIONS``: "gelu" (exact, as timm/BERT), "gelu_tanh"
                (GPT-2), "relu" (the paper), "silu", or gated "swiglu", "geglu", "geglu_tanh".
            dropout: dropout after the activation.
            bias: biases in ``fc1``/``fc2``.
            out_dim: output width; defaults to ``dim``.
            proj_dropout: dropout after ``fc2`` (the residual dropout); default ``dropout``.

        Raises:
            ValueError: on an unknown activation.
        """
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation ({activation!r}) must be one of {ACTIVATIONS}")
        gated = activation in GATED_ACTIVATIONS
        self.fc1 = nn.Linear(dim, 2 * hidden_dim if gated else hidden_dim, bias=bias)
        self.act = build_activation(activation)
        self.drop1 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim, bias=bias)
        self.drop2 = nn.Dropout(dropout if proj_dropout is None else proj_dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(..., D) -> (..., out_dim)."""
        if not self.training:  # dropout is the identity: skipping its calls saves per-token decoding time
            return self.fc2(self.act(self.fc1(x)))
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Zero whole samples of a residual branch with probability ``p``; scale the rest by 1/(1-p).

    Args:
        x: (B, ...) branch output.
        p: drop probability in [0, 1).
        training: identity when False.
    """
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)  # one draw per sample
    return x * x.new_empty(shape).bernoulli_(keep).div_(keep)


class DropPath(nn.Module):
    """Stochastic depth on a residual branch (per sample), identity in eval."""

    def __init__(self, p: float = 0.0) -> None:
        """Args:
            p: drop probability in [0, 1).

        Raises:
            ValueError: if ``p`` is outside [0, 1).
        """
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path probability ({p}) must be in [0, 1)")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / sqrt(mean(x^2) + eps) * (offset + weight) (no mean, no bias).

    Computed in float32 for half-precision inputs. ``offset`` 1 is Gemma's ``(1 + w)`` norm (its
    weights start at zero and are stored that way).
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        """Args:
            dim: normalised (last) dim D.
            eps: added to the mean square.
            offset: added to the weight when scaling (the weight starts at ``1 - offset``).
        """
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: Tensor) -> Tensor:
        """(..., D) -> (..., D)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if not self.offset and self.weight.dtype in (torch.bfloat16, torch.float16):
            # half-precision weights (a bf16 model): Llama's rounding, normalised then scaled in that dtype
            return self.weight * xf.to(x.dtype)
        w = self.weight.float()
        return (xf * (w + self.offset if self.offset else w)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")


def build_norm(kind: str, dim: int, eps: float = 1e-5, bias: bool = True, offset: float = 0.0) -> nn.Module:
    """Build a normalisation layer by short name.

    Args:
        kind: "layernorm" or "rmsnorm".
        dim: normalised (last) dim D.
        eps: numerical epsilon.
        bias: LayerNorm's additive bias (RMSNorm has none).
        offset: RMSNorm scales by ``offset + weight`` (Gemma: 1).

    Raises:
        ValueError: on an unknown name, or an offset for LayerNorm.
    """
    if kind == "layernorm":
        if offset:
            raise ValueError(f"norm_weight_offset ({offset}) applies to rmsnorm only")
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, offset=offset)
    raise ValueError(f"norm ({kind!r}) must be one of {NORMS}")
