"""Tests for tk.core.distributed: single-process defaults and a 2-process gloo job via env vars."""

import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest
import torch

from tk.core import distributed as D
from tk.core.engine import launch
from tk.core.errors import TkError


def test_single_process(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    info = D.init_distributed(device="cpu")
    assert info == D.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert D.is_main_process() and not D.is_distributed() and D.get_world_size() == 1
    t = torch.tensor([3.0])
    assert D.all_reduce_sum(t) is t and t.item() == 3.0
    D.barrier()
    D.cleanup()


def test_bad_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(TkError, match="WORLD_SIZE"):
        D.init_distributed(device="cpu")


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = D.init_distributed(device="cpu")
    try:
        total = D.all_reduce_sum(torch.tensor([rank + 1.0, 10.0]))
        D.barrier()
        queue.put((rank, info.world_size, D.is_main_process(), total.tolist()))
    finally:
        D.cleanup()


def run_two(worker, *args) -> list:
    """``worker(rank, port, queue, *args)`` in 2 spawned processes; what they put, sorted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue, *args)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_two_processes_gloo():
    results = run_two(_worker)
    assert results == [(0, 2, True, [3.0, 20.0]), (1, 2, False, [3.0, 20.0])]


def _probe_worker(rank: int, port: int, queue, folders: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    D.init_distributed(device="cpu")
    try:
        try:
            queue.put((rank, D.ranks_not_seeing(Path(folders[rank]), wait_s=0.5), sorted(os.listdir(folders[rank]))))
        except TkError as e:
            queue.put((rank, str(e), None))
    finally:
        D.cleanup()


@pytest.mark.parametrize("shared", [True, False, "unwritable"])
def test_ranks_not_seeing_a_folder_that_is_not_shared(tmp_path, shared):
    """Rank 1's output_dir is another folder of the same name (a node-local disk, simulated by
    another path): both ranks learn that rank 1 cannot see rank 0's files; the probe is removed.
    A folder rank 0 cannot write in is an error on both ranks (neither waits for the other)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    if shared == "unwritable":
        a = tmp_path / "missing"
    results = run_two(_probe_worker, [str(a), str(a if shared else b)])
    if shared == "unwritable":
        assert [r[1] for r in results] == [f"cannot write in {a} (No such file or directory)"] * 2
        return
    blind = [] if shared else [f"rank 1 on {socket.gethostname()}"]
    assert [r[1] for r in results] == [blind, blind]
    assert os.listdir(a) == [] and os.listdir(b) == []


def test_a_run_dir_not_shared_is_one_line_naming_the_ranks(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(launch, "ranks_not_seeing", lambda folder: seen.append(folder) or ["rank 2 on node-b"])
    for strategy, why in (("fsdp", "every process reads and writes its checkpoint shards there"),
                          ("ddp", "every process reads the task files and the checkpoint to resume from there")):
        with pytest.raises(TkError, match=f"output_dir {tmp_path} is not one folder shared by all processes: "
                                          f"rank 2 on node-b cannot see a file rank 0 wrote there; {why}: use a folder"):
            launch._check_shared(tmp_path, None, strategy)
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setattr(launch, "ranks_not_seeing", lambda folder: [] if folder == tmp_path else ["rank 1 on b"])
    with pytest.raises(TkError, match=f"--resume-from's folder {elsewhere} is not one folder shared"):
        launch._check_shared(tmp_path, str(elsewhere / "step_00000004.pt"), "ddp")
    launch._check_shared(tmp_path, None, "ddp")  # the run dir alone is shared: fine
