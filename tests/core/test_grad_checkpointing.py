"""Activation checkpointing in every core stack: with dropout and stochastic depth on, the loss
and every gradient equal those without it; generation with a KV cache is unaffected; the
engine reaches stacks inside a task's model; `tk run ... train.grad_checkpointing=true` trains."""

from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from torch import Tensor, nn

import tk.core.nn.stack as stack_module
from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.nn.blocks import DecoderLayer, DecoderOnlyLayer, EncoderLayer
from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.nn.text_encoder import TextEncoder
from tk.core.nn.transformer import DecoderOnlyLM, EncoderDecoder, TransformerDecoder, TransformerEncoder
from tk.core.nn.vit import Block, VisionTransformer
from tk.core.training.device import enable_grad_checkpointing

B, T, D, V = 4, 6, 16, 23
LAYERS = (EncoderLayer, DecoderLayer, DecoderOnlyLayer, Block)


def cfg(**kw) -> TransformerConfig:
    """Two small layers with every kind of dropout and stochastic depth on."""
    return TransformerConfig(**{"dim": D, "depth": 2, "num_heads": 2, "dropout": 0.1, "drop_path_rate": 0.2,
                                "max_len": 16, **kw})


class Wrapper(nn.Module):
    """A task's model: a core stack inside, no set_grad_checkpointing of its own."""

    def __init__(self, net: nn.Module, loss_fn: Callable[[nn.Module], Tensor]) -> None:
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def forward(self) -> Tensor:
        return self.loss_fn(self.net)


def weighted(out: Tensor) -> Tensor:
    """A loss whose gradient differs per output element (a plain sum hides some errors)."""
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * w).sum()


def build(kind: str) -> Wrapper:
    torch.manual_seed(0)
    tokens = torch.randint(3, V, (B, T))
    x, memory = torch.randn(B, T, D), nn.Parameter(torch.randn(B, T + 1, D))
    memory_pad = torch.arange(T + 1) >= torch.tensor([[T + 1], [T - 1], [T], [2]])  # (B, T + 1), True at padding
    if kind == "encoder":
        return Wrapper(TransformerEncoder(cfg()), lambda m: weighted(m(x, key_padding_mask=memory_pad[:, :T])))
    if kind == "decoder":
        model = Wrapper(TransformerDecoder(cfg()), lambda m: weighted(m(x, memory, memory_key_padding_mask=memory_pad)))
        model.memory = memory  # a parameter of the wrapper: its gradient (through the checkpoints) is compared too
        return model
    if kind == "encoder_decoder":
        return Wrapper(EncoderDecoder(cfg(), V, V, pad_id=0), lambda m: weighted(m(tokens, tokens)))
    if kind == "decoder_only":
        return Wrapper(DecoderOnlyLM(cfg(pos_encoding="rotary"), V), lambda m: weighted(m(tokens)))
    if kind == "text_encoder":
        return Wrapper(TextEncoder(cfg(pos_encoding="learned"), V), lambda m: weighted(m(tokens)))
    images = torch.randn(B, 3, 16, 16)
    vit = VisionTransformer(img_size=16, patch_size=4, num_classes=5, dim=D, depth=2, num_heads=2, dropout=0.1,
                            attn_dropout=0.1, drop_path_rate=0.2)
    return Wrapper(vit, lambda m: weighted(m(images)))


def loss_and_grads(model: Wrapper, layer_calls: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
    # a pre-hook: the recomputation in backward stops once it has what backward needs
    hooks = [m.register_forward_pre_hook(lambda *_: layer_calls.append(1)) for m in model.modules()
             if isinstance(m, LAYERS)]
    torch.manual_seed(1)  # the same dropout masks in both runs
    loss = model.train()()
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("kind", ["encoder", "decoder", "encoder_decoder", "decoder_only", "text_encoder", "vit"])
def test_checkpointing_keeps_loss_and_every_gradient(kind):
    model = build(kind)
    plain_calls, ckpt_calls = [], []
    loss, grads = loss_and_grads(model, plain_calls)
    enable_grad_checkpointing(model)  # reaches the stack inside the wrapper
    ckpt_loss, ckpt_grads = loss_and_grads(model, ckpt_calls)
    assert len(ckpt_calls) == 2 * len(plain_calls)  # each layer ran again in backward: checkpointing is on
    torch.testing.assert_close(ckpt_loss, loss, atol=1e-6, rtol=0)
    assert grads.keys() == ckpt_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, atol=1e-6, rtol=0, msg=name)
    # a real comparison: most gradients are not zero (stochastic depth may drop a whole branch)
    assert sum(bool(g.abs().sum() > 0) for g in grads.values()) > 0.8 * len(grads)


def test_no_checkpointing_in_eval_or_without_grad(monkeypatch):
    model = build("decoder_only").net
    model.set_grad_checkpointing(True)
    monkeypatch.setattr(stack_module, "checkpoint", lambda *a, **k: pytest.fail("checkpointed"))
    tokens = torch.randint(3, V, (B, T))
    model.eval()(tokens).sum().backward()
    with torch.no_grad():
        model.train()(tokens)


@pytest.mark.parametrize("seq2seq", [False, True])
def test_generation_with_a_kv_cache_is_unaffected(seq2seq, monkeypatch):
    torch.manual_seed(0)
    options = cfg(dropout=0.0, drop_path_rate=0.0, max_len=32)
    model = (EncoderDecoder(options, V, V, pad_id=0) if seq2seq else DecoderOnlyLM(options, V, pad_id=0)).eval()
    inputs = torch.randint(3, V, (B, 4))
    gen = GenerationConfig(max_len=10, bos_id=1, eos_id=2, pad_id=0)
    expected = {s: generate(model, inputs, GenerationConfig(**{**vars(gen), "strategy": s})).tokens
                for s in ("greedy", "beam")}
    model.set_grad_checkpointing(True)
    memory = model.train().encode(inputs) if seq2seq else None  # no cache here: the encoder checkpoints
    monkeypatch.setattr(stack_module, "checkpoint", lambda *a, **k: pytest.fail("checkpointed while decoding"))
    model.eval()
    for strategy, tokens in expected.items():
        assert torch.equal(generate(model, inputs, GenerationConfig(**{**vars(gen), "strategy": strategy})).tokens,
                           tokens)
    # even in training mode with gradients on, a step that fills a cache is never recomputed
    model.train()
    cache = model.init_cache(B, 16)
    if seq2seq:
        model.decode_step(inputs[:, :1], memory, None, cache).sum().backward()
    else:
        model.decode_step(inputs, cache).sum().backward()
    assert cache.length == (1 if seq2seq else 4)


def test_a_model_without_any_checkpointable_part_is_named():
    with pytest.raises(TkError, match="train.grad_checkpointing: Sequential has no set_grad_checkpointing"):
        enable_grad_checkpointing(nn.Sequential(nn.Linear(4, 4)))


def test_lm_recipe_trains_with_grad_checkpointing(tmp_path):
    args = ["run", "lm_synthetic", f"output_dir={tmp_path / 'run'}", "train.grad_checkpointing=true",
            "train.max_steps=3", "train.eval_every=3", "data.num_sentences=300", "data.eval_blocks=2",
            "train.batch_size=4", "train.num_workers=0", "train.progress=false", "train.log_every=1"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "grad checkpointing" in result.output
