"""Model configs: one :class:`TransformerConfig` passed to every Transformer layer, stack and
model (nanoGPT's ``GPTConfig``), and :class:`ViTConfig` for the Vision Transformer.

A plugin's ``model:`` section embeds or subclasses these, so a recipe key is a field name.
The recipe loader calls ``check()`` on every section; the modules call :meth:`validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, ClassVar, Literal

from tk.core.nn.lora import LoRAConfig
from tk.core.nn.rope import rope_scaling_problems

# gelu: exact (erf); gelu_tanh: the tanh approximation (GPT-2 gelu_new, gelu_pytorch_tanh); geglu /
# geglu_tanh / swiglu: gated (fc1 packs [gate; value]: Gemma uses geglu_tanh, Llama swiglu)
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu", "geglu_tanh")
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
NORMS = ("layernorm", "rmsnorm")
POS_ENCODINGS = ("sinusoidal", "learned", "rotary", "none")
# interleaved: sin, cos, sin, ... (the 2017 paper, tk); split: all sines then all cosines (Marian);
# fairseq: split, frequencies 10000^(-i / (D/2 - 1)) (tensor2tensor: fairseq, M2M100, NLLB)
SINUSOID_LAYOUTS = ("interleaved", "split", "fairseq")
POOLINGS = ("cls", "mean")


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class TransformerConfig:
    """Shape and regularisation of a Transformer: the ``model:`` section of text models.

    A task's ``model:`` section that builds one stack sets ``unused_keys = ENCODER_DECODER_KEYS``:
    ``tk info`` leaves them out and a recipe that sets one is told it does nothing there."""

    unused_keys: ClassVar[tuple[str, ...]] = ()  # fields this task's model never reads

    dim: int = 256  # model width D (token vector size)
    depth: int = 4  # layers per stack (encoder-decoder: default of encoder_depth and decoder_depth)
    encoder_depth: int | None = None  # encoder layers of an encoder-decoder; None = depth
    decoder_depth: int | None = None  # decoder layers of an encoder-decoder; None = depth
    num_heads: int = 4  # attention (query) heads H; dim must be divisible by it
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads, 1 = MQA
    mlp_ratio: float = 4.0  # feed-forward hidden width / dim (used when hidden_dim is None)
    hidden_dim: int | None = None  # feed-forward hidden width in units; None = int(dim * mlp_ratio)
    activation: Literal["gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu", "geglu_tanh"] = "gelu"  # feed-forward activation (gated: swiglu, geglu, geglu_tanh)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # normalisation layer kind
    norm_eps: float = 1e-5  # epsilon added inside every norm
    norm_first: bool = True  # pre-norm (GPT, ViT) if true; post-norm (the 2017 paper) if false
    final_norm: bool | None = None  # norm after the last layer of each stack; None = norm_first
    bias: bool = True  # biases in the attention and feed-forward linear layers
    norm_bias: bool = True  # LayerNorm's additive bias (nanoGPT's bias=False drops it too); RMSNorm has none
    dropout: float = 0.1  # residual dropout (each sublayer's output) and dropout on the input embeddings
    attn_dropout: float | None = None  # dropout on attention weights; None = dropout
    mlp_dropout: float | None = None  # dropout after the feed-forward activation; None = dropout
    drop_path_rate: float = 0.0  # stochastic depth of the last layer, rising linearly from 0 at the first
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "sinusoidal"  # position information
    max_len: int = 1024  # positions in the learned/sinusoidal table (tokens); learned raises beyond it
    tie_embeddings: bool = True  # output projection shares the (target) token embedding weight
    share_embeddings: bool = False  # encoder-decoder: one embedding for source and target (one joint vocab)
    head_dim: int | None = None  # width Dh of one attention head; None = dim // num_heads (Gemma, Qwen3 set it apart)
    qkv_bias: bool | None = None  # biases of the q/k/v projections; None = bias (Qwen2: true, the rest false)
    proj_bias: bool | None = None  # bias of the attention output projection; None = bias
    mlp_bias: bool | None = None  # biases of the feed-forward linears; None = bias
    qk_norm: bool = False  # RMSNorm over each head's queries and keys, before rotary (Qwen3)
    norm_weight_offset: float = 0.0  # norms scale by (offset + weight): Gemma's (1 + w) RMSNorm is 1.0
    scale_embedding: bool = False  # decoder-only LM: token embeddings times sqrt(dim) (Gemma); encoder-decoders always scale
    rope_theta: float = 10000.0  # rotary frequency base (Llama 3: 5e5, Qwen2.5: 1e6)
    rope_scaling: dict[str, Any] | None = None  # rotary frequency scaling as transformers writes it: {rope_type: linear|llama3, factor: ..., ...}
    attn_scale: float | None = None  # attention score scale; None = head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5)
    attn_logit_softcapping: float | None = None  # attention scores -> c * tanh(score / c) before the softmax (Gemma 2: 50)
    final_logit_softcapping: float | None = None  # output logits -> c * tanh(logit / c) (Gemma 2: 30)
    sandwich_norm: bool = False  # pre-norm layers also normalise each sublayer's output before the residual add (Gemma 2)
    sliding_window: int | None = None  # causal self-attention sees only the last N positions, itself included (Mistral); None = all
    layer_types: list[str] | None = None  # per layer full_attention or sliding_attention (Gemma 2 alternates); None = sliding_window everywhere
    sinusoid_layout: Literal["interleaved", "split", "fairseq"] = "interleaved"  # sinusoidal table: interleaved (tk), split [sin | cos] (Marian), fairseq (M2M100, NLLB)
    pos_offset: int = 0  # the sinusoidal table starts at this position (M2M100/NLLB: 2, fairseq's pad + 1)
    pad_aware_positions: bool = False  # encoder-decoder: source positions count real tokens only (fairseq, M2M100): a left-padded row gets what it gets alone
    logits_bias: bool = False  # encoder-decoder: a fixed (1, V) bias added to the logits, a buffer not trained (Marian's final_logits_bias)
    lora: LoRAConfig | None = None  # low-rank adapters, the rest frozen (docs/lora.md); null: train every weight

    # -- derived values ----------------------------------------------------------------
    @property
    def ffn_dim(self) -> int:
        """Feed-forward hidden width: ``hidden_dim`` or ``int(dim * mlp_ratio)``."""
        return self.hidden_dim if self.hidden_dim is not None else int(self.dim * self.mlp_ratio)

    @property
    def attn_head_dim(self) -> int:
        """Width of one attention head: ``head_dim`` or ``dim // num_heads``."""
        return self.head_dim if self.head_dim is not None else self.dim // max(self.num_heads, 1)

    def biases(self) -> tuple[bool, bool, bool]:
        """(q/k/v, attention output, feed-forward) biases: each flag or, where None, ``bias``."""
        return tuple(self.bias if b is None else b for b in (self.qkv_bias, self.proj_bias, self.mlp_bias))

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attn_dropout_p(self) -> float:
        """Dropout on attention weights (``attn_dropout``, default ``dropout``)."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    @property
    def mlp_dropout_p(self) -> float:
        """Dropout after the feed-forward activation (``mlp_dropout``, default ``dropout``)."""
        return self.dropout if self.mlp_dropout is None else self.mlp_dropout

    @property
    def use_final_norm(self) -> bool:
        """Whether each stack ends with a norm (``final_norm``, default ``norm_first``)."""
        return self.norm_first if self.final_norm is None else self.final_norm

    # -- validation --------------------------------------------------------------------
    def check(self, prefix: str = "model") -> list[str]:
        """Problems of this config, one line each, keys named as ``{prefix}.field``."""
        k = partial(_key, prefix)
        problems = [f"{k(name)}: this task's model is a single stack; {name} applies to encoder-decoders "
                    f"(translation) only; remove it" for name in self.unused_keys
                    if getattr(self, name) != getattr(type(self), name, None)]
        for name in ("dim", "depth", "num_heads", "max_len"):
            if getattr(self, name) < 1:
                problems.append(f"{k(name)} ({getattr(self, name)}) must be >= 1")
        for name in ("encoder_depth", "decoder_depth", "num_kv_heads", "hidden_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{k(name)} ({value}) must be >= 1 or null")
        if self.num_heads >= 1 and self.dim % self.num_heads and self.head_dim is None:
            problems.append(f"{k('dim')} ({self.dim}) must be divisible by {k('num_heads')} ({self.num_heads}), "
                            f"or set {k('head_dim')}")
        kv = self.num_kv_heads
        if kv is not None and kv >= 1 and self.num_heads % kv:
            problems.append(f"{k('num_heads')} ({self.num_heads}) must be divisible by {k('num_kv_heads')} ({kv})")
        if not self.mlp_ratio > 0:
            problems.append(f"{k('mlp_ratio')} ({self.mlp_ratio}) must be > 0")
        for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("pos_encoding", POS_ENCODINGS),
                              ("sinusoid_layout", SINUSOID_LAYOUTS)):
            if getattr(self, name) not in allowed:
                problems.append(f"{k(name)} ({getattr(self, name)!r}) must be one of {', '.join(allowed)}")
        if not self.norm_eps > 0:
            problems.append(f"{k('norm_eps')} ({self.norm_eps}) must be > 0")
        for name in ("dropout", "attn_dropout", "mlp_dropout", "drop_path_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                problems.append(f"{k(name)} ({value}) must be in [0, 1)")
        head_dim = self.attn_head_dim if self.num_heads >= 1 else 0
        if self.pos_encoding == "rotary" and head_dim % 2:
            how = f"{k('head_dim')}" if self.head_dim is not None else f"{k('dim')} / {k('num_heads')}"
            problems.append(f"{k('pos_encoding')} 'rotary' needs an even head dim, got {how} = {head_dim}")
        problems += self._variant_problems(k)
        if self.lora is not None:
            problems += self.lora.check(k("lora"))
        return problems

    def _variant_problems(self, k: Any) -> list[str]:
        """The checks of the options pretrained decoder families add."""
        problems = []
        for name in ("head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{k(name)} ({value}) must be >= 1 or null")
        for name in ("attn_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{k(name)} ({value}) must be > 0 or null")
        if self.pos_offset < 0:
            problems.append(f"{k('pos_offset')} ({self.pos_offset}) must be >= 0")
        if not self.rope_theta > 0:
            problems.append(f"{k('rope_theta')} ({self.rope_theta}) must be > 0")
        problems += rope_scaling_problems(self.rope_scaling, k("rope_scaling"))
        if self.rope_scaling is not None and self.pos_encoding != "rotary":
            problems.append(f"{k('rope_scaling')} needs {k('pos_encoding')} 'rotary'")
        if self.layer_types is not None:
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if bad:
                problems.append(f"{k('layer_types')} has {bad}; each must be one of {', '.join(LAYER_TYPES)}")
            for name in ("depth", "decoder_depth"):
                n = getattr(self, name)
                if name == "depth" and self.decoder_depth is None or name == "decoder_depth" and n is not None:
                    if n is not None and len(self.layer_types) != n:
                        problems.append(f"{k('layer_types')} lists {len(self.layer_types)} layers but "
                                        f"{k(name)} is {n}")
        if self.sandwich_norm and not self.norm_first:
            problems.append(f"{k('sandwich_norm')} needs {k('norm_first')} true (it adds norms to pre-norm layers)")
        return problems

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # rebuilt from JSON or asdict() (a task file, a source's spec)
            self.lora = LoRAConfig(**self.lora)

    def validate(self) -> None:
        """Raise on any :meth:`check` problem (what modules call when built from code).

        Raises:
            ValueError: all problems, joined by "; ".
        """
        problems = self.check(prefix="")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    @classmethod
    def of(cls, section: object, **overrides: object) -> TransformerConfig:
        """A plain ``TransformerConfig`` from the shape fields of ``section`` (a plugin's
        ``model:`` section that subclasses this class and adds keys of its own, such as a
        pooling or a head dropout, which are left out), with ``overrides`` on top.

        Example: ``TransformerConfig.of(model_cfg, max_len=data_cfg.max_len)``.
        """
        values = {f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}
        return cls(**{**values, **overrides})


@dataclass
class ViTConfig(TransformerConfig):
    """A Vision Transformer (timm layout: pre-norm blocks, learned positions); defaults are
    ViT-B/16. The input size, channels and classes are constructor arguments (data facts)."""

    dim: int = 768  # model width D (token vector size)
    depth: int = 12  # number of blocks
    num_heads: int = 12  # attention heads H; dim must be divisible by it
    norm_eps: float = 1e-6  # epsilon added inside every norm (timm: 1e-6)
    dropout: float = 0.0  # residual dropout, feed-forward dropout and dropout on the positions (timm drop_rate)
    attn_dropout: float | None = 0.0  # dropout on attention weights (timm attn_drop_rate); None = dropout
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "learned"  # only "learned" (a 2-D grid table)
    patch_size: int = 16  # patch side P in pixels; must divide the image size
    stem: Literal["patch", "conv"] = "patch"  # patch: one P x P conv (timm); conv: 3x3 stride-2 convs + BN
    pooling: Literal["cls", "mean"] = "cls"  # classifier input: class token, or mean of patch tokens then norm
    distilled: bool = False  # DeiT: add a distillation token and head_dist (needs pooling "cls")

    def check(self, prefix: str = "model") -> list[str]:
        """:meth:`TransformerConfig.check` plus the ViT's own rules."""
        k = partial(_key, prefix)
        problems = super().check(prefix)
        if self.patch_size < 1:
            problems.append(f"{k('patch_size')} ({self.patch_size}) must be >= 1")
        if self.stem not in ("patch", "conv"):
            problems.append(f"{k('stem')} ({self.stem!r}) must be 'patch' or 'conv'")
        elif self.stem == "conv" and (self.patch_size < 2 or self.patch_size & (self.patch_size - 1)):
            problems.append(f"{k('stem')} 'conv' needs {k('patch_size')} to be a power of two >= 2, "
                            f"got {self.patch_size}")
        if self.pooling not in POOLINGS:
            problems.append(f"{k('pooling')} ({self.pooling!r}) must be one of {', '.join(POOLINGS)}")
        if self.distilled and self.pooling != "cls":
            problems.append(f"{k('distilled')} needs {k('pooling')} 'cls' (the DeiT heads read the two tokens)")
        if not self.norm_first:
            problems.append(f"{k('norm_first')} must be true for the ViT (timm's blocks are pre-norm)")
        if self.pos_encoding != "learned":
            problems.append(f"{k('pos_encoding')} ({self.pos_encoding!r}) must be 'learned' for the ViT")
        for name in ("encoder_depth", "decoder_depth"):
            if getattr(self, name) is not None:
                problems.append(f"{k(name)} is not used by the ViT; set {k('depth')} instead")
        return problems


ENCODER_DECODER_KEYS = ("encoder_depth", "decoder_depth", "share_embeddings", "pad_aware_positions", "logits_bias")  # an encoder-decoder's own fields
