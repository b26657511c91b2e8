"""Tests for tk.core.distributed: single-process defaults and a 2-process gloo job via env vars."""

import multiprocessing as mp
import os
import socket

import pytest
import torch

from tk.core import distributed as D
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


def test_two_processes_gloo():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [(0, 2, True, [3.0, 20.0]), (1, 2, False, [3.0, 20.0])]
