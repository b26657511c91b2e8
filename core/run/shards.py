"""Sharded checkpoints of ``train.strategy: fsdp`` runs, through ``torch.distributed.checkpoint``
(DCP): every process writes its own shard of the model and optimiser state into one folder,
so no process ever holds the full state. A run's ``checkpoints/step_XXXXXXXX.pt`` (and its
``last.pt``/``best.pt`` copies) then hold the small trainer state and the folder's name,
``shards/step_XXXXXXXX``, relative to the ``.pt`` file's folder.

The folder is read back sharded by any number of processes (DCP re-shards on load), or in
full by one process (evaluation, export, averaging, a pretrained source) without a process
group. Every process must see the folder: on several nodes, the run dir lives on a shared
file system.

DCP: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tk.core.errors import TkError
from tk.core.run.atomic import fsync_dir

__all__ = ["SHARDS_KEY", "SHARDS_DIR", "shard_folder", "sharded_training_state", "save_shards", "load_shards",
           "read_full_model", "check_shards", "shard_steps"]

SHARDS_KEY = "sharded"  # in a tk checkpoint: its DCP folder, relative to the checkpoint's folder
SHARDS_DIR = "shards"
_METADATA = ".metadata"  # DCP writes it last (rank 0), after every shard


def shard_folder(directory: Path, step: int) -> Path:
    """The DCP folder of update ``step`` in a run's ``checkpoints/`` folder."""
    return Path(directory) / SHARDS_DIR / f"step_{step:08d}"


def shard_steps(directory: Path) -> dict[int, Path]:
    """The complete shard folders under ``directory/shards`` by step (temp folders excluded)."""
    root = Path(directory) / SHARDS_DIR
    found = {}
    if root.is_dir():
        for folder in root.iterdir():
            name = folder.name
            if folder.is_dir() and name.startswith("step_") and name[5:].isdigit():
                found[int(name[5:])] = folder
    return found


def sharded_training_state(model: nn.Module, optimizer) -> dict[str, Any]:
    """The model's and optimiser's state dicts as this process's shards (DTensors; the
    optimiser's keyed by parameter name), for :func:`save_shards`. Collective."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _main_then_all(is_main: bool, work: Callable[[], Any]) -> Any:
    """Run ``work`` (file operations) on the main process alone and hand its result to every
    process, or raise its error on every process: a failure on one process alone would leave
    the others waiting in the next collective. Collective."""
    box: list[Any] = [(None, None)]
    if is_main:
        try:
            box = [(work(), None)]
        except OSError as e:
            box = [(None, str(e))]
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise TkError(f"saving the checkpoint's shards: {error}")
    return result


def save_shards(directory: Path, step: int, state: dict[str, Any], is_main: bool, reuse: bool = False) -> str:
    """Write ``state`` (:func:`sharded_training_state`) as the shard folder of ``step``, every
    process its own file: into a temp folder, renamed into place once complete, so a killed
    save leaves no half folder under the final name. ``reuse``: this run already saved this
    step's shards (the same weights; only the best metric changed), keep them. The main
    process decides and moves folders; every process learns the outcome. Collective.

    Returns:
        The folder relative to ``directory``, for the checkpoint file's :data:`SHARDS_KEY`.

    Raises:
        TkError: on every process, when the main process cannot create or rename the folders.
    """
    final = shard_folder(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")
    relative = final.relative_to(directory).as_posix()

    def prepare() -> bool:
        if reuse and (final / _METADATA).is_file():
            return True
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return False

    def publish() -> None:
        if final.exists():  # this step's folder from an earlier attempt at the same step: replaced
            old = final.with_name(f".{final.name}.old.tmp")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(final.parent)

    if _main_then_all(is_main, prepare):
        return relative
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))  # raises on every process
    _main_then_all(is_main, publish)  # after every shard and the metadata are on disk
    return relative


def check_shards(folder: Path) -> None:
    """Raise a one-line error when ``folder`` is not a complete DCP folder: its ``.metadata``
    (written last) and every shard file it lists, long enough for the bytes it points to."""
    folder = Path(folder)
    if not (folder / _METADATA).is_file():
        raise TkError(f"the checkpoint's shard folder {folder} is missing or incomplete (no {_METADATA}); "
                      f"a sharded checkpoint's .pt needs its shard folder beside it (copy checkpoints/ whole), or "
                      f"use another checkpoint of the run")
    try:
        storage = getattr(FileSystemReader(folder).read_metadata(), "storage_data", None) or {}
    except Exception as e:  # a truncated or foreign pickle
        raise TkError(f"the checkpoint's shard folder {folder} has a damaged {_METADATA} ({_first_line(e)[:200]}); "
                      f"use another checkpoint of the run") from None
    needed: dict[str, int] = {}  # shard file -> bytes the metadata points into
    for info in storage.values():
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = folder / name
        have = path.stat().st_size if path.is_file() else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated ({have} of {size} bytes)"
            raise TkError(f"the checkpoint's shard folder {folder} is incomplete: {name} {what} (each process "
                          f"writes one shard file); use another checkpoint of the run")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_shards(folder: Path, model: nn.Module, optimizer) -> None:
    """Load a shard folder into a sharded ``model`` and its ``optimizer``, whatever the
    number of processes that wrote it (DCP re-shards). Collective.

    Raises:
        TkError: the folder holds another model (names the first missing or mismatching entry).
    """
    check_shards(folder)
    state = sharded_training_state(model, optimizer)
    try:
        dcp.load(state, storage_reader=FileSystemReader(folder))
    except (Exception, CheckpointException) as e:  # DCP wraps each rank's failure (a BaseException)
        detail = _first_line(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            detail = _first_line(first[0] if isinstance(first, tuple) else first)
        raise TkError(f"the checkpoint's shards in {folder} do not fit this model ({detail[:300]})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_full_model(folder: Path) -> dict[str, Any]:
    """The full model state dict of a shard folder, read by this process alone (no process
    group; every shard is read, so the whole model must fit in this process's memory)."""
    check_shards(folder)
    reader = FileSystemReader(folder)
    prefix = "model."  # DCP stores nested dicts flattened, ``model.<parameter name>``
    model: dict[str, Any] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            model[key[len(prefix):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "no process group: loading in one process", which is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model
