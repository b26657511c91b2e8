"""Process-group setup from torchrun's environment, and small collectives that are
no-ops in a single process.

torchrun: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tk.core.errors import TkError

__all__ = [
    "DistInfo", "init_distributed", "is_distributed", "get_rank", "get_world_size",
    "is_main_process", "barrier", "all_reduce_sum", "comm_device", "cleanup", "float64_vector", "agreed_log_keys",
    "ranks_not_seeing",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int  # global rank, 0 .. world_size - 1
    local_rank: int  # rank on this machine (picks the GPU)
    world_size: int  # number of processes in the job
    device: torch.device  # the device this process trains on


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise TkError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_distributed(device: str | None = None) -> DistInfo:
    """Join the process group described by torchrun's ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE`` (plus ``MASTER_ADDR``/``MASTER_PORT``); a single process otherwise.

    The backend is NCCL when the device is CUDA and gloo otherwise. Calling it when the
    group already exists just reports the current placement.

    Args:
        device: ``"cpu"``, ``"cuda"`` or None (CUDA when available). On CUDA each process
            uses GPU ``LOCAL_RANK``.

    Raises:
        TkError: CUDA requested but unavailable, or too few GPUs for ``LOCAL_RANK``.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TkError(f"device {kind!r} requested but CUDA is not available; use device: cpu")
        if local_rank >= torch.cuda.device_count():
            raise TkError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(kind)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0: the process that logs and writes checkpoints."""
    return get_rank() == 0


def comm_device() -> torch.device:
    """Device that collectives need: the current GPU for NCCL, CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for all processes (no-op in a single process)."""
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the block on rank 0 first, then on the other ranks.

    For one-time preparation that writes shared files (dataset downloads, tokenizer
    training): rank 0 does the work while the others wait, then they find it done.
    """
    if is_distributed() and dist.get_rank() != 0:
        dist.barrier()
    try:
        yield
    finally:
        if is_distributed() and dist.get_rank() == 0:
            dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all processes, in place, and return it (no-op in one process).

    The tensor may live on any device: it is moved to :func:`comm_device` for the
    collective and the result copied back.
    """
    if not is_distributed():
        return tensor
    buf = tensor.to(comm_device())
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def cleanup() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def float64_vector(values: list[Any], device: torch.device) -> torch.Tensor:
    """0-dim tensors and numbers, in order, as one float64 vector on ``device`` (one
    host-to-device copy for all the numbers), e.g. to all-reduce them together."""
    numbers = torch.tensor([float(v) for v in values if not torch.is_tensor(v)], dtype=torch.float64,
                           device=device).unbind()
    it = iter(numbers)
    return torch.stack([v.to(device, torch.float64).reshape(()) if torch.is_tensor(v) else next(it) for v in values])


def agreed_log_keys(keys: list[str], world_size: int) -> list[str]:
    """``keys`` if every process logs the same ones (a collective), so the per-update
    all-reduce of the log values never mixes up or hangs on vectors of other lengths.

    Raises:
        TkError: processes log different keys (names them).
    """
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, keys)
    if any(other != keys for other in gathered):
        shown = "; ".join(f"rank {r}: {k}" for r, k in enumerate(gathered))
        raise TkError(f"StepOutput.logs must have the same keys on every batch and process, got {shown}; "
                      f"log a 0 where a value does not apply")
    return keys


def ranks_not_seeing(folder: Path, wait_s: float = 10.0) -> list[str]:
    """The processes (``"rank R on HOST"``) that do not see a file rank 0 writes in ``folder``:
    empty when ``folder`` is one folder shared by every process (a collective; ``[]`` in one
    process). Rank 0 writes a probe with a fresh name and removes it after; the others look
    for it for up to ``wait_s`` seconds (a network filesystem may show a new file late).

    Raises:
        TkError: (on every process) rank 0 cannot write in ``folder``.
    """
    if not is_distributed():
        return []
    box: list[Any] = [f".tk-probe-{uuid.uuid4().hex}", None]  # the probe's name, rank 0's error
    if dist.get_rank() == 0:
        try:
            (folder / box[0]).write_bytes(b"")
        except OSError as e:  # told to every process: none waits at the next collective
            box[1] = f"cannot write in {folder} ({e.strerror or e})"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise TkError(box[1])
    path, deadline = folder / box[0], time.monotonic() + wait_s

    def visible() -> bool:
        try:
            return path.is_file()
        except OSError:  # e.g. permission denied on this node: not seen, and still at the gather below
            return False

    while not (seen := visible()) and time.monotonic() < deadline:
        time.sleep(0.2)
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if dist.get_rank() == 0:
        path.unlink(missing_ok=True)
    return [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
