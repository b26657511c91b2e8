"""Rotary position embedding (RoPE) and the frequency scalings pretrained decoders use.

Papers: RoFormer (Su et al., 2021), https://arxiv.org/abs/2104.09864; linear position
interpolation (Chen et al., 2023), https://arxiv.org/abs/2306.15595; Llama 3.1's wavelength-
dependent scaling ("The Llama 3 Herd of Models", 2024), https://arxiv.org/abs/2407.21783.

``rope_scaling`` takes transformers' ``rope_scaling`` / ``rope_parameters`` dict as it stands in
a ``config.json``: ``{"rope_type": "linear", "factor": 4.0}`` or ``{"rope_type": "llama3",
"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
"original_max_position_embeddings": 8192}`` (v4 configs call the key ``type``). Any other kind
is refused by name (see :func:`rope_scaling_problems`): never a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

# rope kinds and the keys each needs (transformers' modeling_rope_utils names)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The kind of a ``rope_scaling`` dict (``rope_type``, or v4's ``type``; None: "default")."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_scaling_problems(scaling: Mapping[str, Any] | None, key: str = "model.rope_scaling") -> list[str]:
    """Why ``scaling`` cannot be computed, one line each (empty when it can)."""
    if scaling is None:
        return []
    if not isinstance(scaling, Mapping):
        return [f"{key} ({scaling!r}) must be a mapping such as {{rope_type: linear, factor: 4.0}} or null"]
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        return [f"{key}.rope_type ({kind!r}) is not implemented; tk computes {', '.join(ROPE_TYPES)}"]
    problems = [f"{key}.{name} is missing (rope_type {kind!r} needs {', '.join(ROPE_TYPES[kind])})"
                for name in ROPE_TYPES[kind] if name not in scaling]
    if not problems and kind != "default" and not float(scaling["factor"]) > 0:
        problems.append(f"{key}.factor ({scaling['factor']}) must be > 0")
    if not problems and kind == "llama3" and scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        problems.append(f"{key}: high_freq_factor and low_freq_factor must differ")
    return problems


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """The rotary inverse frequencies (Dh/2,) float32 for base ``theta``, scaled as ``scaling`` says.

    Raises:
        ValueError: a scaling :func:`rope_scaling_problems` refuses.
    """
    problems = rope_scaling_problems(scaling, "rope_scaling")
    if problems:
        raise ValueError("; ".join(problems))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    kind = rope_type(scaling)
    if kind == "linear":  # positions interpolated: every frequency divided by the factor
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: Tensor, s: Mapping[str, Any]) -> Tensor:
    """Long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), applied to queries and keys inside attention.

    Uses the "rotate half" layout (GPT-NeoX / LLaMA in HF): channel j is paired with
    channel j + Dh/2. The cos/sin tables grow on demand, so any length works. Pass it to
    ``MultiHeadAttention(..., rotary=RotaryEmbedding(head_dim))``; the attention supplies
    the offset (the KV-cache length) during cached decoding.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: Mapping[str, Any] | None = None) -> None:
        """Args:
            head_dim: Dh, must be even.
            base: frequency base (``rope_theta``).
            scaling: a ``rope_scaling`` dict (module docstring); None = unscaled.

        Raises:
            ValueError: if ``head_dim`` is odd or ``scaling`` is refused.
        """
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RotaryEmbedding head_dim ({head_dim}) must be even")
        self.head_dim, self.base, self.scaling = head_dim, base, dict(scaling) if scaling else None
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, self.scaling), persistent=False)
        # the cos/sin tables are a cache, not buffers: they grow with the longest input a process has
        # seen, and DDP's per-step buffer broadcast of tables of different lengths breaks its collective
        self._cos = torch.empty(0, head_dim, device=self.inv_freq.device)
        self._sin = torch.empty(0, head_dim, device=self.inv_freq.device)

    def reset_buffers(self, device: torch.device | str = "cpu") -> None:
        """Compute the frequencies again on ``device`` (a model built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling).to(device)
        self._cos = torch.empty(0, self.head_dim, device=device)
        self._sin = torch.empty(0, self.head_dim, device=device)

    def _tables(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._cos.shape[0] < length or self._cos.device != device:
            n = max(length, 2 * self._cos.shape[0])  # grow geometrically
            # Ordinary tensors even when grown inside generate()'s inference_mode: training
            # afterwards saves them for backward, which inference tensors cannot be.
            with torch.inference_mode(False):
                pos = torch.arange(n, dtype=torch.float32, device=device)
                freqs = torch.outer(pos, self.inv_freq.to(device))  # (n, Dh/2)
                emb = torch.cat([freqs, freqs], dim=-1)  # (n, Dh)
                self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Rotate x by its positions.

        Args:
            x: (B, H, T, Dh) queries or keys.
            offset: position of x's first token.
            positions: (B, T) long, each token's own position, below T (packed rows: restarting at
                every document, so each is rotated exactly as it is alone); overrides ``offset``.

        Returns:
            (B, H, T, Dh), same dtype as x (float32 tables; half-precision x is rotated in its
            own dtype with the tables rounded to it, as transformers does).
        """
        T = x.shape[-2]
        if positions is not None:
            cos, sin = self._tables(T, x.device)  # positions restart inside the row: each < T (no host sync)
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, Dh)
        else:
            cos, sin = self._tables(offset + T, x.device)
            cos, sin = cos[offset : offset + T], sin[offset : offset + T]  # (T, Dh)
        if x.dtype in (torch.bfloat16, torch.float16):  # in x's dtype, tables rounded to it (as transformers)
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            return x * cos + _rotate_half(x) * sin
        return x * cos + _rotate_half(x) * sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}" + (f", scaling={self.scaling}" if self.scaling else "")


def build_rotary(cfg: Any) -> RotaryEmbedding:
    """The rotary module of a :class:`TransformerConfig` (its head dim, ``rope_theta``, ``rope_scaling``)."""
    return RotaryEmbedding(cfg.attn_head_dim, cfg.rope_theta, cfg.rope_scaling)
