"""Data-parallel strategies (``train.strategy``): DDP, where every process holds the whole
model and all-reduces gradients, and FSDP2, where parameters, gradients and optimiser state
are sharded over the processes per Transformer block and gathered block by block for the
forward and backward passes.

FSDP2 (``fully_shard``): https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
ZeRO: https://arxiv.org/abs/1910.02054
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.modules.batchnorm import _BatchNorm

from tk.core.errors import TkError
from tk.core.training.build import wrap_ddp

__all__ = ["wrap_model", "shard_blocks", "is_fsdp", "gradient_sync", "gathered", "full_model_state",
           "load_full_training_state"]

_BLOCK_LISTS = ("layers", "blocks")  # core TransformerStack.layers; timm ViT.blocks
_PARAM_DTYPES = {"bf16": torch.bfloat16}  # fp16 is refused with fsdp (core/config.py)
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, in CPU memory


def is_fsdp(model: nn.Module) -> bool:
    """True for a model sharded by ``fully_shard``."""
    return isinstance(model, FSDPModule)


def block_lists(model: nn.Module) -> list[list[nn.Module]]:
    """The model's ``layers``/``blocks`` module lists (core stacks, timm ViTs), outermost
    first, each list's blocks in the order they run."""
    lists: list[list[nn.Module]] = []
    for _, module in model.named_modules():
        for attr in _BLOCK_LISTS:
            blocks = getattr(module, attr, None)
            if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and not any(b in found for found in lists
                                                                                for b in blocks):
                lists.append(list(blocks))
    return lists


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The Transformer blocks FSDP shards one by one: the items of every ``layers``/``blocks``
    module list (core stacks, timm ViTs), outermost first."""
    return [block for blocks in block_lists(model) for block in blocks]


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every process starts from rank 0's weights (DDP does this in its constructor;
    ``fully_shard`` shards whatever each process built)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def wrap_fsdp(model: nn.Module, device: torch.device, world_size: int, precision: str = "fp32",
              reshard: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each Transformer block, then the root (embeddings,
    heads and the rest), over a 1-D device mesh of all processes. On CUDA, bf16 ``precision``
    becomes FSDP's parameter dtype (gradients reduced in fp32). ``reshard``: free a block's
    gathered weights after its forward and gather them again in backward (least memory);
    False keeps them gathered from forward to backward (one all-gather per block per update).
    The last block and the root are never resharded after forward: backward needs them first
    (torchtitan's choice).

    Raises:
        TkError: one process, or no block list found in the model.
    """
    blocks = shard_blocks(model)
    if not blocks:
        raise TkError(f"train.strategy: fsdp: {type(model).__name__} has no `layers` or `blocks` module list "
                      f"of Transformer blocks to shard; use train.strategy=ddp or give the model such a list")
    if world_size < 2:
        raise TkError("train.strategy: fsdp shards the model over several processes; start them with "
                      "`tk run --nproc-per-node N` (N >= 2), or use train.strategy=ddp for one process")
    if device.type == "cuda" and precision in _PARAM_DTYPES and any(isinstance(m, _BatchNorm) for m in model.modules()):
        # FSDP2 would cast BatchNorm's weight to bf16 but not its fp32 running statistics: the op fails
        raise TkError(f"train.strategy: fsdp with train.precision={precision} on CUDA casts BatchNorm weights but "
                      f"not their running statistics ({type(model).__name__} has BatchNorm, e.g. model.stem=conv); "
                      f"use train.precision=fp32, train.strategy=ddp, or a model without BatchNorm")
    fill = getattr(model, "tk_fill_weights", None)  # a pretrained model left on the meta device to load its shards
    if fill is None:
        _broadcast_from_rank0(model)
    mesh = init_device_mesh(device.type, (world_size,))
    options: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda" and precision in _PARAM_DTYPES:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES[precision], reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **options)
    fully_shard(model, reshard_after_forward=False, **options)
    if fill is not None:  # each process allocates and reads only its own shards
        model.to_empty(device=device)
        fill(model)
        del model.tk_fill_weights
    for siblings in block_lists(model):
        _prefetch_neighbours(siblings, async_unshard=device.type == "cpu")
    for module in model.modules():  # what gathered() restores
        if isinstance(module, FSDPModule):
            module._tk_reshard = module is not model and reshard and module is not blocks[-1]
    return model


def _prefetch_neighbours(blocks: list[nn.Module], async_unshard: bool) -> None:
    """Gather the next block's weights while this one computes: in forward the block after,
    in backward the block before (FSDP2's explicit prefetching), within one module list (the
    order in which they run; nested lists, e.g. timm Swin's stages, prefetch within each). ``async_unshard`` (CPU/gloo,
    which has no CUDA streams to overlap on): issue every all-gather asynchronously, so that
    gloo's thread moves the next block while this process computes; measured 1.44x -> 1.18x
    DDP's step time in ``benchmarks/fsdp.py`` on 2 CPU processes."""
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
        if async_unshard and hasattr(block, "_set_unshard_async_op"):  # private in torch 2.x, no public twin
            block._set_unshard_async_op(True)


def wrap_model(model: nn.Module, strategy: str, device: torch.device, world_size: int,
               precision: str = "fp32", fsdp_reshard: bool = True) -> nn.Module:
    """``model`` ready for data-parallel training: wrapped in DDP (``ddp``; as it is for one
    process) or sharded in place (``fsdp``: the returned model is ``model``)."""
    if strategy == "fsdp":
        return wrap_fsdp(model, device, world_size, precision, fsdp_reshard)
    return wrap_ddp(model, device, world_size)


def autocast_needed(strategy: str, device: torch.device) -> bool:
    """Whether the run's bf16 comes from autocast: not for FSDP on CUDA, whose
    ``MixedPrecisionPolicy`` casts the parameters instead."""
    return not (strategy == "fsdp" and device.type == "cuda")


def gradient_sync(model: nn.Module, sync: bool) -> ContextManager:
    """Context for one micro-batch's backward: without ``sync`` gradients only accumulate
    locally (DDP's ``no_sync``; FSDP2's ``set_requires_gradient_sync(False)``), the last
    micro-batch of an update reduces them all."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    no_sync = None if sync else getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Run the block with a sharded model's full weights on every process (one all-gather per
    block, kept until the end), so that evaluation may call any method (generation, on rank 0
    alone) and ranks may run different numbers of batches; resharded afterwards. Other
    models: nothing happens."""
    if not is_fsdp(model):
        yield
        return
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            # back to wrap_fsdp's choice (train.fsdp_reshard; the last block and the root keep their weights)
            module.set_reshard_after_forward(getattr(module, "_tk_reshard", True), recurse=False)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict: on rank 0 in CPU memory, empty on the other
    ranks for a sharded model (a collective: call on every process); ``state_dict()`` otherwise."""
    return get_model_state_dict(model, options=_FULL) if is_fsdp(model) else model.state_dict()


def load_full_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                             optim_state: dict) -> None:
    """Shard full model and optimiser state dicts (optimiser state keyed by parameter name, as
    checkpoints of FSDP runs before sharded checkpoints held them) into ``model`` and
    ``optimizer``; every process passes the full dicts it read."""
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, strict=True))
