"""Text samplers: token-budget batches (budget, exactly-once sharding with equal counts,
seeded order, low padding, resume by index, 2 gloo processes) and endless random batches
as a pure function of (seed, batch number), sliced by rank."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from tk.core import LoaderSpec, RandomBlockSampler, RandomIndexSampler, TkError, TokenBudgetBatchSampler, build_loader
from tk.core.training.batches import BatchStream, agreed_length

from ..conftest import make_distribution

TOY_TEXT = (Path(__file__).with_name("toy_text.py")).read_text()


def skewed_lengths(n=3000, seed=0):
    return (1 + np.random.default_rng(seed).lognormal(3.0, 1.0, n)).astype(int).clip(max=400)


def padding_fraction(batches, lengths):
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded


def test_greedy_batches_by_hand():
    # ascending: 1 (#1), 2 (#5), 3 (#2), 3 (#3), 5 (#0), 8 (#4); budget 8 per batch x longest
    s = TokenBudgetBatchSampler([5, 1, 3, 3, 8, 2], max_tokens=8, shuffle=False)
    assert s.pass_batches() == [[1, 5], [2, 3], [0], [4]] and len(s) == 4
    # 3 processes: the two 2-example batches are halved (6 batches), nothing repeated
    s3 = [TokenBudgetBatchSampler([5, 1, 3, 3, 8, 2], max_tokens=8, shuffle=False, rank=r, world_size=3)
          for r in range(3)]
    assert s3[0].pass_batches() == [[1], [5], [2], [3], [0], [4]] and s3[0].num_repeated == 0
    assert [list(s) for s in s3] == [[[1], [3]], [[5], [0]], [[2], [4]]]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_token_budget_shards_skewed_lengths(world_size):
    lengths = skewed_lengths()
    max_tokens = 1024

    def shards(epoch):
        out = []
        for rank in range(world_size):
            s = TokenBudgetBatchSampler(lengths, max_tokens, seed=7, rank=rank, world_size=world_size)
            s.set_epoch(epoch)
            out.append(list(s))
            assert s.num_repeated == 0
        return out

    for epoch in (0, 1):
        per_rank = shards(epoch)
        assert len({len(b) for b in per_rank}) == 1  # equal batch counts: DDP never waits
        assert len(per_rank[0]) == len(TokenBudgetBatchSampler(lengths, max_tokens, world_size=world_size))
        batches = [b for rank in per_rank for b in rank]
        assert all(len(b) * lengths[b].max() <= max_tokens for b in batches)
        counts = collections.Counter(i for b in batches for i in b)
        assert sorted(counts) == list(range(len(lengths))) and set(counts.values()) == {1}  # exactly once
    assert shards(1) == shards(1)  # a pure function of (seed, epoch): fresh samplers agree
    assert shards(1) != shards(2)


def test_token_budget_pads_far_less_than_random_batches():
    lengths = skewed_lengths()
    s = TokenBudgetBatchSampler(lengths, 1024, seed=1)
    ours = list(s)
    size = round(len(lengths) / len(ours))  # random batches of the same average size
    perm = np.random.default_rng(0).permutation(len(lengths))
    random_batches = [perm[i:i + size].tolist() for i in range(0, len(perm), size)]
    ours_pad, random_pad = padding_fraction(ours, lengths), padding_fraction(random_batches, lengths)
    assert 2 * ours_pad <= random_pad, (ours_pad, random_pad)


def test_too_long_example_is_named_or_skipped():
    with pytest.raises(TkError, match=r"example 2 has 9 tokens, more than max_tokens=8 \(1 such"):
        TokenBudgetBatchSampler([3, 4, 9, 1], max_tokens=8)
    s = TokenBudgetBatchSampler([3, 4, 9, 1], max_tokens=8, skip_too_long=True)
    assert s.skipped == [2] and sorted(i for b in s for i in b) == [0, 1, 3]


def test_tiny_dataset_repeats_the_first_batches_for_equal_counts():
    shards = [TokenBudgetBatchSampler([4, 4], max_tokens=4, rank=r, world_size=3) for r in range(3)]
    assert shards[0].num_repeated == 1 and [len(s) for s in shards] == [1, 1, 1]
    seen = [i for s in shards for b in s for i in b]
    first = shards[0].pass_batches()[0]
    assert sorted(seen) == sorted([0, 1] + first)  # the repeated batch is the first of the pass


def test_load_state_dict_skips_by_index():
    lengths = skewed_lengths(500)
    s = TokenBudgetBatchSampler(lengths, 512, seed=3, rank=1, world_size=2)
    s.set_epoch(4)
    full = list(s)
    it = iter(s)
    next(it), next(it), next(it)
    assert s.state_dict() == {"epoch": 4, "batch": 3}
    fresh = TokenBudgetBatchSampler(lengths, 512, seed=3, rank=1, world_size=2)
    fresh.load_state_dict({"epoch": 4, "batch": 3})
    assert list(fresh) == full[3:]
    assert list(fresh) == full  # a finished pass: the next one starts from its beginning


class CountingItems(Dataset):
    """Items with random noise (augmentation) that count their loads."""

    def __init__(self, n):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand())])


def test_batch_stream_resumes_a_token_budget_pass_without_loading_skipped_batches():
    lengths = skewed_lengths(300)
    spec = LoaderSpec(batch_size=1, shuffle=True, seed=2)

    def stream(data):
        sampler = TokenBudgetBatchSampler.from_spec(spec, lengths, 512)
        return BatchStream(build_loader(data, spec, batch_sampler=sampler), batches_per_epoch=10, seed=2), sampler

    ref, _ = stream(CountingItems(len(lengths)))
    for _ in range(13):  # pass 0, then 3 batches of pass 1
        ref.next()
    assert ref.state_dict() == {"epoch": 1, "batch": 3}
    torch.manual_seed(5)  # the RNG state a checkpoint would restore
    np.random.seed(5)
    expected = [ref.next() for _ in range(12)]  # the rest of pass 1, then pass 2
    data = CountingItems(len(lengths))
    resumed, sampler = stream(data)
    resumed.load_state_dict({"epoch": 1, "batch": 3})
    torch.manual_seed(5)
    np.random.seed(5)
    got = [resumed.next() for _ in range(12)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(data.loaded) == sum(len(b) for b in got)  # no item of the 3 skipped batches
    sampler.set_epoch(1)
    assert data.loaded[:len(got[0])] == sampler.pass_batches()[3]


def test_random_index_sampler_is_a_pure_function_of_seed_rank_and_batch():
    s = RandomIndexSampler(1000, 16, seed=3, rank=1, world_size=2)
    it = iter(s)
    first = [next(it) for _ in range(8)]
    assert first[5] == s.batch(5) and all(0 <= i < 1000 for b in first for i in b)
    assert s.state_dict() == {"batch": 8}
    resumed = RandomIndexSampler(1000, 16, seed=3, rank=1, world_size=2)
    resumed.load_state_dict({"epoch": 0, "batch": 5})
    assert next(iter(resumed)) == first[5]
    # the two ranks' batches are one process's batch of 32, split in order
    one = RandomIndexSampler(1000, 32, seed=3)
    assert RandomIndexSampler(1000, 16, seed=3, rank=0, world_size=2).batch(5) + first[5] == one.batch(5)
    assert RandomIndexSampler(1000, 16, seed=4, rank=1, world_size=2).batch(5) != first[5]
    with pytest.raises(ValueError, match=r"rank \(2\) must be in \[0, world_size\)"):
        RandomIndexSampler(1000, 16, rank=2, world_size=2)
    with pytest.raises(TypeError):
        len(s)


def test_random_blocks_fit_the_token_array():
    s = RandomBlockSampler(num_tokens=100, block_size=33, batch_size=64, seed=0)
    offsets = [o for k in range(50) for o in s.batch(k)]
    assert min(offsets) == 0 and max(offsets) == 100 - 33  # every start, and no block overruns
    with pytest.raises(ValueError, match="block_size"):
        RandomBlockSampler(num_tokens=10, block_size=11, batch_size=2)


@pytest.mark.parametrize("batching", ["default", "random"])
def test_workers_resumed_mid_pass_draw_the_same_augmentations(batching):
    """Loader workers are seeded per batch, so a pass that starts at batch k (resume)
    loads batch k with the random numbers of an uninterrupted pass."""
    spec = LoaderSpec(batch_size=4, shuffle=True, seed=1, num_workers=2)

    def stream():
        data = CountingItems(40)
        sampler = RandomIndexSampler.from_spec(spec, 40) if batching == "random" else None
        loader = build_loader(data, spec, batch_sampler=sampler)
        return BatchStream(loader, batches_per_epoch=None if sampler else 10, seed=1)

    ref = stream()
    reference = [ref.next() for _ in range(14)]
    resumed = stream()
    resumed.load_state_dict({"epoch": 0, "batch": 5})
    got = [resumed.next() for _ in range(9)]
    for a, b in zip(got, reference[5:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len({round(float(b[0, 1]), 6) for b in reference}) == 14  # batches really differ


RECIPE = """\
task: toy_text
data: {num_train: 230, num_val: 48, batching: tokens, max_tokens: 96, mean_log_len: 2.5}
model: {hidden: 32}
optim: {lr: 0.01}
train: {epochs: 2, log_every: 1, progress: false, device: cpu}
"""


@pytest.mark.slow
def test_two_gloo_processes_train_on_token_budgets_without_a_hang(tmp_path):
    site = make_distribution(tmp_path / "site", "tk-toy-text", "tk_toy_text", TOY_TEXT,
                             {"toy_text": "tk_toy_text:ToyTextTask"})
    recipe = tmp_path / "text.yaml"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "run"
    path = os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("tk")), "run", str(recipe), f"output_dir={run_dir}",
         "--nproc-per-node", "2"], env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=False,
        timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(2 processes)" in proc.stdout
    sys.path.insert(0, str(site))
    try:
        from tk_toy_text import ToyTextData, make_sequences
    finally:
        sys.path.remove(str(site))
    d = ToyTextData(num_train=230, mean_log_len=2.5)
    lengths = [len(s) for s in make_sequences(230, d, d.seed + 1)]
    per_epoch = len(TokenBudgetBatchSampler(lengths, 96, world_size=2))
    assert len(TokenBudgetBatchSampler(lengths, 96)) == 2 * per_epoch - 1  # odd: one batch was halved
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "val"] == [per_epoch, 2 * per_epoch]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 2 * per_epoch + 1))


def _agree(rank, init, out):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        (out / f"{rank}.json").write_text(json.dumps(agreed_length([[0]] * (5 + rank), 2)))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_processes_agree_on_the_fewest_batches_per_pass(tmp_path):
    torch.multiprocessing.spawn(_agree, args=(f"file://{tmp_path / 'rendezvous'}", tmp_path), nprocs=2)
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)] == [[5, 6], [5, 6]]
