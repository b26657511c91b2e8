"""``lm_shakespeare_char_gpu`` is nanoGPT's baby GPT: with the reference's weights, tk's model
computes the reference's logits (``benchmarks/baby_gpt.py``, nanoGPT's model written out again)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from tk.core.nn.config import TransformerConfig
from tk.core.nn.transformer import DecoderOnlyLM
from tk.core.optim import build_optimizer
from tk.core.recipe import load_config

REPO = Path(__file__).resolve().parents[2]
VOCAB = 65  # tiny Shakespeare's characters


def reference_module():
    spec = importlib.util.spec_from_file_location("baby_gpt", REPO / "benchmarks" / "baby_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def reference_to_tk(sd: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """nanoGPT's parameter names -> tk's (both keep q, k, v stacked in one (3 D, D) matrix)."""
    out = {"tok_embed.weight": sd["wte.weight"], "pos.weight": sd["wpe.weight"],
           "decoder.norm.weight": sd["ln_f.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(depth):
        src, dst = f"blocks.{i}.", f"decoder.layers.{i}."
        for a, b in (("ln_1", "norm1"), ("ln_2", "norm2"), ("attn.c_attn", "self_attn.qkv"),
                     ("attn.c_proj", "self_attn.proj"), ("mlp.0", "mlp.fc1"), ("mlp.2", "mlp.fc2")):
            out[f"{dst}{b}.weight"] = sd[f"{src}{a}.weight"]
    return out


def test_gpu_recipe_model_is_nanogpts_baby_gpt():
    cfg, _ = load_config(REPO / "recipes" / "lm_shakespeare_char_gpu.yaml")
    m = cfg.sections["model"]
    baby = reference_module()
    c = baby.Config()
    assert (m.dim, m.depth, m.num_heads, m.max_len, cfg.sections["data"].block_size) == (c.n_embd, c.n_layer, c.n_head,
                                                                             c.block_size, c.block_size)
    torch.manual_seed(0)
    reference = baby.GPT(c, VOCAB).eval()
    ours = DecoderOnlyLM(TransformerConfig.of(m), VOCAB).eval()
    # the same parameters, no more (no LayerNorm biases, no linear biases), the embedding tied
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
    assert ours.lm_head.weight is ours.tok_embed.weight
    ours.load_state_dict(reference_to_tk(reference.state_dict(), c.n_layer), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens), atol=1e-5, rtol=1e-5)
    # and the same dropouts in training: the embeddings', the attention weights', each residual branch's;
    # none after the MLP's activation (nanoGPT has none there)
    assert (m.dropout, m.attn_dropout_p, m.mlp_dropout_p) == (c.dropout, c.dropout, 0.0)


def test_gpu_recipe_decays_what_nanogpt_decays():
    """nanoGPT decays every 2-D tensor (the embeddings too), nothing else."""
    cfg, _ = load_config(REPO / "recipes" / "lm_shakespeare_char_gpu.yaml")
    baby = reference_module()
    c = baby.Config()
    ours = DecoderOnlyLM(TransformerConfig.of(cfg.sections["model"]), VOCAB)
    reference = baby.GPT(c, VOCAB)

    def decayed(optimizer):  # (elements with decay, elements without)
        sizes = {True: 0, False: 0}
        for group in optimizer.param_groups:
            sizes[group["weight_decay"] > 0] += sum(p.numel() for p in group["params"])
        return sizes

    theirs = decayed(baby.make_optimizer(reference, c, torch.device("cpu")))
    assert decayed(build_optimizer(ours, cfg.optim)) == theirs
    assert cfg.optim.weight_decay == c.weight_decay and tuple(cfg.optim.betas) == (c.beta1, c.beta2)
