"""Sharded checkpoints (``tk.core.run.shards``): DCP folders written by every process of
an fsdp run, read back sharded by any number of processes or in full by one; their rotation,
set-aside and damage handling in the checkpoint manager (one-process folders: no process group)."""

import os
import re
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig
from tk.core.nn.transformer import DecoderOnlyLM
from tk.core.run import checkpoint as C
from tk.core.run.shards import SHARDS_KEY, load_shards, read_full_model, save_shards, sharded_training_state
from tk.core.training.parallel import full_model_state, wrap_fsdp


def _fake_shards(directory, step):
    """A real DCP folder of one process (``.metadata`` + ``__0_0.distcp``) holding a small tensor."""
    folder = directory / "shards" / f"step_{step:08d}"
    with warnings.catch_warnings():  # "no process group": one process writes it, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.arange(64.0)}}, storage_writer=FileSystemWriter(folder), no_dist=True)
    return folder


def _save_sharded(manager, step, metric=None):
    _fake_shards(manager.directory, step)
    return manager.save({"step": step, SHARDS_KEY: f"shards/step_{step:08d}"}, step=step, metric=metric)


def _shard_names(directory):
    return sorted(p.name for p in (directory / "shards").iterdir())


def test_rotation_keeps_the_shards_of_kept_files_and_best(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=2)
    for step, metric in ((1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)):
        _save_sharded(manager, step, metric)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_00000003.pt", "step_00000004.pt"]
    assert _shard_names(tmp_path) == ["step_00000001", "step_00000003", "step_00000004"]  # 1: best.pt's
    best = C.load_checkpoint(tmp_path / "best.pt", full_model=False)
    assert best["step"] == 1 and best[SHARDS_KEY] == str(tmp_path / "shards" / "step_00000001")
    assert [p.name for p in C.intact_checkpoints(tmp_path)][:2] == ["last.pt", "best.pt"]


def test_a_lost_shard_folder_is_one_line_and_the_file_is_not_intact(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        _save_sharded(manager, step)
    (tmp_path / "shards" / "step_00000002" / ".metadata").unlink()  # a save killed before DCP finished
    with pytest.raises(C.CheckpointReadError) as err:
        C.load_checkpoint(tmp_path / "step_00000002.pt")
    message = str(err.value)
    assert "\n" not in message and "step_00000002" in message and "another checkpoint" in message
    assert [p.name for p in C.intact_checkpoints(tmp_path)] == ["step_00000001.pt"]


@pytest.mark.parametrize("damage", ["missing", "truncated", "metadata"])
def test_a_shard_folder_missing_a_file_is_one_line(tmp_path, damage):
    """A shard file lost or cut short (its .metadata intact), or a damaged .metadata: one line naming
    the file, before any reader or DCP traceback; the checkpoint is not intact."""
    manager = C.CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        _save_sharded(manager, step)
    folder = tmp_path / "shards" / "step_00000002"
    shard = folder / "__0_0.distcp"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        (folder / ".metadata").write_bytes(b"not a pickle")
    expected = {"missing": "is incomplete: __0_0.distcp is missing",
                "truncated": "is incomplete: __0_0.distcp is truncated (100 of ",
                "metadata": "has a damaged .metadata"}[damage]
    with pytest.raises(C.CheckpointReadError, match=re.escape(expected)) as err:
        C.load_checkpoint(tmp_path / "step_00000002.pt")
    assert "\n" not in str(err.value) and "another checkpoint" in str(err.value)
    assert [p.name for p in C.intact_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert torch.equal(read_full_model(tmp_path / "shards" / "step_00000001")["w"], torch.arange(64.0))


def test_resuming_from_an_older_step_moves_the_later_shards_aside_with_their_files(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=5)
    for step, metric in ((1, 0.1), (2, 0.9), (3, 0.5)):
        _save_sharded(manager, step, metric)
    _fake_shards(tmp_path, 4)  # a save killed after its shards, before its file
    (tmp_path / "shards" / ".step_00000005.tmp").mkdir()  # ... and one killed while writing them
    folder = manager.prepare_resume(1)
    assert _shard_names(tmp_path) == ["step_00000001"]
    assert sorted(p.name for p in folder.iterdir()) == ["best.pt", "shards", "step_00000002.pt", "step_00000003.pt"]
    assert _shard_names(folder) == ["step_00000002", "step_00000003"]
    moved = C.load_checkpoint(folder / "step_00000003.pt", full_model=False)  # still finds its shards
    assert moved[SHARDS_KEY] == str(folder / "shards" / "step_00000003")


def test_a_second_abandoned_branch_gets_its_own_folder_and_keeps_its_shards(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        _save_sharded(manager, step)
    first = manager.prepare_resume(1)
    for step in (2, 3):  # the second branch from step 1
        _save_sharded(manager, step)
    (tmp_path / "shards" / "step_00000002" / "__0_0.distcp").write_bytes(b"second")
    second = manager.prepare_resume(1)
    assert first.name == "abandoned_after_00000001" and second.name == "abandoned_after_00000001_2"
    for folder in (first, second):
        assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_00000002.pt", "step_00000003.pt"]
        assert _shard_names(folder) == ["step_00000002", "step_00000003"]
    assert (second / "shards" / "step_00000002" / "__0_0.distcp").read_bytes() == b"second"


def test_a_set_aside_killed_midway_is_finished_into_the_same_folder(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        _save_sharded(manager, step)
    aside = tmp_path / "abandoned_after_00000001"
    (aside / "shards").mkdir(parents=True)  # killed after moving step 2's shards and file, and step 3's shards
    (tmp_path / "shards" / "step_00000002").rename(aside / "shards" / "step_00000002")
    (tmp_path / "step_00000002.pt").rename(aside / "step_00000002.pt")
    (tmp_path / "shards" / "step_00000003").rename(aside / "shards" / "step_00000003")
    assert manager.prepare_resume(1) == aside
    assert sorted(p.name for p in aside.glob("step_*.pt")) == ["step_00000002.pt", "step_00000003.pt"]
    for step in (2, 3):
        C.load_checkpoint(aside / f"step_{step:08d}.pt", full_model=False)  # each finds its shards


def test_rotation_keeps_what_best_pt_names_when_the_index_lags(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=1)
    _save_sharded(manager, 1, metric=0.5)
    _save_sharded(manager, 2, metric=0.9)  # best.pt: step 2
    manager.info["best"]["step"] = 1  # as if killed between best.pt and the index
    _save_sharded(manager, 3, metric=0.1)
    assert C.load_checkpoint(tmp_path / "best.pt", full_model=False)["step"] == 2  # its shards are kept
    assert _shard_names(tmp_path) == ["step_00000002", "step_00000003"]


def _tiny_lm(seed: int, depth: int = 2) -> DecoderOnlyLM:
    torch.manual_seed(seed)
    return DecoderOnlyLM(TransformerConfig(dim=16, depth=depth, num_heads=2, dropout=0.0, max_len=16), 11)


def _trained(seed: int, depth: int = 2):
    model = wrap_fsdp(_tiny_lm(seed, depth), torch.device("cpu"), 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _step(model, optimizer, rank):
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(tokens).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _locals(model):
    return {n: p.detach().to_local().clone() for n, p in model.named_parameters()}


def _dcp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, optimizer = _trained(0)
        _step(model, optimizer, rank)
        relative = save_shards(Path(out), 1,
                               sharded_training_state(model, optimizer), is_main=rank == 0)
        full = full_model_state(model)
        # a fresh model and optimiser of another seed, loaded from the folder, step on identically
        other, other_optimizer = _trained(1)
        _step(other, other_optimizer, rank)  # so that its optimiser holds state to overwrite
        load_shards(Path(out) / relative, other, other_optimizer)
        loaded_same = all(torch.equal(a, b) for a, b in zip(_locals(model).values(), _locals(other).values()))
        _step(model, optimizer, rank + 10)
        _step(other, other_optimizer, rank + 10)
        stepped_same = all(torch.equal(a, b) for a, b in zip(_locals(model).values(), _locals(other).values()))
        deeper, deeper_optimizer = _trained(0, depth=3)
        try:
            load_shards(Path(out) / relative, deeper, deeper_optimizer)
            refused = None
        except TkError as e:
            refused = str(e)
        if rank == 0:
            torch.save({"relative": relative, "full": full, "loaded_same": loaded_same, "stepped_same": stepped_same,
                        "refused": refused}, f"{out}/result.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_shards_round_trip_over_two_processes_and_read_in_full_by_one(tmp_path):
    """Model and AdamW state saved sharded by 2 processes load into another model exactly (the
    next update too); one process reads the full weights with no process group; a deeper model
    is refused in one line that names a missing entry."""
    mp.spawn(_dcp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["relative"] == "shards/step_00000001"
    assert sorted(p.name for p in (tmp_path / "shards" / "step_00000001").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert result["loaded_same"] and result["stepped_same"]
    full = read_full_model(tmp_path / "shards" / "step_00000001")
    assert sorted(full) == sorted(result["full"])
    for key, value in result["full"].items():
        assert torch.equal(full[key], value), key
    assert result["refused"] is not None and "\n" not in result["refused"]
    assert "do not fit this model" in result["refused"] and "layers.2" in result["refused"]
