"""StreamingDataset (issue #36 item 2): split by rank and loader worker, each sample once per
pass, the order a function of (seed, epoch) alone, and a pass that starts at any batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tk.core.data.stream as stream
from tk.core.data import LoaderSpec, build_loader
from tk.core.data.stream import StreamingDataset


class ListSource:
    """A shard of integers; counts how many raw samples were read."""

    def __init__(self, items: list[int]) -> None:
        self.items, self.reads = items, 0

    def __len__(self) -> int:
        return len(self.items)

    def read(self, start: int, stop: int):
        for x in self.items[start:stop]:
            self.reads += 1
            yield x


def shards(sizes=(7, 13, 5, 11)) -> list[ListSource]:
    out, n = [], 0
    for size in sizes:
        out.append(ListSource(list(range(n, n + size))))
        n += size
    return out


def batches(spec: LoaderSpec, epoch: int = 0, start: int = 0, buffer_size: int = 8) -> list[list[int]]:
    ds = StreamingDataset(shards(), buffer_size=buffer_size)
    loader = build_loader(ds, spec)
    ds.set_epoch(epoch)
    ds.load_state_dict({"epoch": epoch, "batch": start})
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_training_pass_gives_each_rank_the_same_number_of_whole_batches_and_no_sample_twice(world):
    spec = dict(batch_size=4, shuffle=True, drop_last=True, seed=3, world_size=world)
    per_rank = [batches(LoaderSpec(rank=r, **spec)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == (36 // world) // 4
    seen = [x for b in per_rank for batch in b for x in batch]
    assert all(len(batch) == 4 for b in per_rank for batch in b)
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(36))
    assert seen != sorted(seen)  # shuffled


@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_reads_every_sample_once_across_ranks_in_order(world):
    spec = dict(batch_size=4, shuffle=False, drop_last=False, world_size=world)
    seen = [x for r in range(world) for batch in batches(LoaderSpec(rank=r, **spec)) for x in batch]
    assert seen == list(range(36))


def test_order_depends_on_seed_and_epoch_and_each_worker_reads_its_own_lane():
    spec = dict(batch_size=4, shuffle=True, drop_last=True, seed=1, rank=1, world_size=2)
    plain = batches(LoaderSpec(**spec))
    assert batches(LoaderSpec(**spec), epoch=1) != plain
    assert batches(LoaderSpec(**{**spec, "seed": 2})) != plain
    assert batches(LoaderSpec(**spec)) == plain
    two = batches(LoaderSpec(num_workers=2, **spec))  # other lanes, the same samples
    assert two == batches(LoaderSpec(num_workers=2, **spec)) and sorted(map(sorted, two)) != sorted(map(sorted, plain))
    assert sorted(x for b in two for x in b) == sorted(x for b in plain for x in b)


def test_every_raw_sample_is_read_once_per_pass_across_workers(monkeypatch):
    ds = StreamingDataset(shards(), buffer_size=5)
    ds.bind(batch_size=4, shuffle=True, drop_last=True, seed=0, rank=0, world_size=1)
    seen = []
    for lane in range(3):  # what worker `lane` of 3 reads
        monkeypatch.setattr(stream, "get_worker_info", lambda lane=lane: SimpleNamespace(id=lane, num_workers=3))
        seen += list(ds)
    assert len(seen) == len(set(seen)) == 36 and sum(s.reads for s in ds.sources) == 36


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_started_at_batch_k_yields_the_rest_of_the_uninterrupted_pass(workers):
    spec = LoaderSpec(batch_size=3, shuffle=True, drop_last=True, seed=5, num_workers=workers)
    full = batches(spec, epoch=2)
    for k in (1, 3, len(full) - 1):
        assert batches(spec, epoch=2, start=k) == full[k:]


def test_resume_reads_from_the_block_of_its_first_sample():
    ds = StreamingDataset(shards(), buffer_size=8)
    build_loader(ds, LoaderSpec(batch_size=4, shuffle=False, drop_last=True))
    ds.load_state_dict({"epoch": 0, "batch": 6})  # samples 24.. : blocks 24-31 and 32-35
    assert [x for b in build_loader(ds, LoaderSpec(batch_size=4, drop_last=True)) for x in b.tolist()] == \
        list(range(24, 36))
    assert sum(s.reads for s in ds.sources) == 12


def test_the_engine_resumes_a_streamed_loader_without_replaying(monkeypatch):
    from tk.core.training.batches import BatchStream

    ds = StreamingDataset(shards(), transform=lambda x: torch.tensor(x), buffer_size=8)
    loader = build_loader(ds, LoaderSpec(batch_size=4, shuffle=True, drop_last=True, seed=7))
    stream = BatchStream(loader, len(loader), seed=7)
    full = [stream.next().tolist() for _ in range(2 * len(loader))]
    resumed = BatchStream(loader, len(loader), seed=7)
    resumed.load_state_dict({"epoch": 1, "batch": 4})
    calls = []
    monkeypatch.setattr(ds, "transform", lambda x: calls.append(x) or torch.tensor(x))
    assert [resumed.next().tolist() for _ in range(len(loader) - 4)] == full[len(loader) + 4:]
    assert len(calls) == (len(loader) - 4) * 4  # only the batches after the position were transformed


def test_resuming_a_stream_with_other_loader_workers_is_refused():
    from tk.core.errors import TkError
    from tk.core.training.batches import BatchStream

    def stream(workers: int) -> BatchStream:
        ds = StreamingDataset(shards(), buffer_size=8)
        loader = build_loader(ds, LoaderSpec(batch_size=4, shuffle=True, drop_last=True, num_workers=workers))
        return BatchStream(loader, len(loader))

    state = stream(2).state_dict()
    assert state == {"epoch": 0, "batch": 0, "stream_lanes": [2, 1]}
    stream(2).load_state_dict(state)
    with pytest.raises(TkError, match=r"saved with train.num_workers=2 on 1 process\(es\) and resumes with 0 on 1"):
        stream(0).load_state_dict(state)
