"""Tests for tk.core.run.checkpoint: round trip with RNG, atomicity under a crash, rotation,
mismatch messages, averaging by hand, safetensors export of tied weights."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from tk.core.errors import TkError
from tk.core.exchange.export import average_checkpoints, export_safetensors
from tk.core.run import checkpoint as C


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(2).tolist(), random.gauss(0, 1)


def test_round_trip_with_rng(tmp_path):
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "rng": C.capture_rng_state(),
             "config": {"optim": {"lr": 0.1, "betas": [0.9, 0.999]}}}
    C.save_checkpoint(tmp_path / "a.pt", state)
    expected = _draws()
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    loaded = C.load_checkpoint(tmp_path / "a.pt")
    assert loaded["step"] == 7 and loaded["config"] == state["config"] and "_tk_checkpoint" not in loaded
    torch.testing.assert_close(loaded["model"]["weight"], model.weight.detach())
    C.restore_rng_state(loaded["rng"])
    assert _draws() == expected


def test_load_errors(tmp_path):
    with pytest.raises(TkError, match="does not exist"):
        C.load_checkpoint(tmp_path / "nope.pt")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(TkError, match="not a tk checkpoint"):
        C.load_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a zip file at all")
    with pytest.raises(TkError, match=r"is not a checkpoint \(not a torch.save zip file\)"):
        C.load_checkpoint(tmp_path / "junk.pt")
    C.save_checkpoint(tmp_path / "cut.pt", {"w": torch.zeros(100)})
    (tmp_path / "cut.pt").write_bytes((tmp_path / "cut.pt").read_bytes()[:300])
    with pytest.raises(C.CheckpointReadError, match="cannot read checkpoint .*: the file is truncated or damaged") as e:
        C.load_checkpoint(tmp_path / "cut.pt")
    assert "miniz" not in str(e.value) and "\n" not in str(e.value)  # not torch's paragraph


def test_a_damaged_checkpoint_names_the_intact_ones_beside_it(tmp_path):
    folder = tmp_path / "checkpoints"
    for name in ("last.pt", "best.pt", "step_00000002.pt", "step_00000004.pt"):
        C.save_checkpoint(folder / name, {"w": torch.zeros(10)})
    (folder / "best.pt").write_bytes((folder / "best.pt").read_bytes()[:200])
    (folder / "step_00000002.pt").write_bytes(b"PK")
    with pytest.raises(C.CheckpointReadError) as e:
        C.load_checkpoint(folder / "best.pt")
    assert str(e.value).endswith("; intact checkpoints beside it: last.pt, step_00000004.pt; use one of them instead")
    assert "intact" not in e.value.problem


def test_crash_during_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    C.save_checkpoint(path, {"step": 1, "w": torch.ones(1000)})
    real_save = torch.save

    def crashing_save(obj, f, *args, **kwargs):
        real_save(obj, tmp_path / "full.bin")
        data = (tmp_path / "full.bin").read_bytes()
        f.write(data[: len(data) // 2])  # half a file, then the "crash"
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        C.save_checkpoint(path, {"step": 2, "w": torch.zeros(1000)})
    monkeypatch.setattr(torch, "save", real_save)
    assert C.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "full.bin"]  # no temp file left


def test_manager_keep_last_best_and_last(tmp_path):
    mgr = C.CheckpointManager(tmp_path / "ck", keep_last=2)
    assert mgr.latest() is None and mgr.best() is None
    metrics = {10: 0.5, 20: 0.7, 30: 0.6, 40: float("nan")}
    for step, m in metrics.items():
        mgr.save({"step": step}, step, metric=m, mode="max")
    names = sorted(p.name for p in (tmp_path / "ck").glob("*.pt"))
    assert names == ["best.pt", "last.pt", "step_00000030.pt", "step_00000040.pt"]
    assert C.load_checkpoint(mgr.latest())["step"] == 40
    assert C.load_checkpoint(mgr.best())["step"] == 20  # its step file is gone, best.pt is not
    # the best metric survives a restart; mode="min" would prefer lower values
    mgr2 = C.CheckpointManager(tmp_path / "ck", keep_last=2)
    mgr2.save({"step": 50}, 50, metric=0.65)
    assert C.load_checkpoint(mgr2.best())["step"] == 20
    mgr3 = C.CheckpointManager(tmp_path / "ck3", keep_last=1)
    for step, m in ((1, 3.0), (2, 1.0), (3, 2.0)):
        mgr3.save({"step": step}, step, metric=m, mode="min")
    assert C.load_checkpoint(mgr3.best())["step"] == 2
    assert [p.name for p in sorted((tmp_path / "ck3").glob("step_*"))] == ["step_00000003.pt"]


class Net(nn.Module):
    def __init__(self, d: int = 4, out: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, d)
        self.norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, out)


def test_load_model_state_mismatch_message():
    torch.manual_seed(0)
    sd = Net(out=3).state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["norm.running_mean"]
    with pytest.raises(TkError) as err:
        C.load_model_state(Net(out=5), sd)
    msg = str(err.value)
    assert "1 missing key(s): norm.running_mean" in msg
    assert "1 unexpected key(s): extra.weight" in msg
    assert "2 shape mismatch(es): head.bias: checkpoint (3,) vs model (5,)" in msg
    assert "another model or config" in msg
    model = Net(out=5)
    C.load_model_state(model, sd, strict=False)  # loads what fits
    torch.testing.assert_close(model.embed.weight, sd["embed.weight"])
    # DDP-style prefixes are stripped
    good = Net()
    C.load_model_state(good, {"module." + k: v for k, v in Net().state_dict().items()})


def test_average_checkpoints_by_hand(tmp_path):
    paths = []
    for i, (w, count) in enumerate([(1.0, 3), (2.0, 5), (6.0, 9)]):
        sd = {"w": torch.full((2,), w, dtype=torch.bfloat16), "n": torch.tensor(count)}
        C.save_checkpoint(tmp_path / f"{i}.pt", {"model": sd, "step": i})
        paths.append(tmp_path / f"{i}.pt")
    avg = average_checkpoints(paths)
    assert avg["w"].dtype == torch.bfloat16 and avg["w"].tolist() == [3.0, 3.0]
    assert avg["n"].item() == 9 and avg["n"].dtype == torch.long
    C.save_checkpoint(tmp_path / "odd.pt", {"model": {"w": torch.zeros(3), "n": torch.tensor(1)}})
    with pytest.raises(TkError, match="other keys or shapes"):
        average_checkpoints([paths[0], tmp_path / "odd.pt"])


def test_export_safetensors_tied_weights(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    model[1].weight = model[0].weight  # tied
    export_safetensors(model, tmp_path / "m.safetensors", metadata={"task": "toy"})
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == {"0.weight", "1.weight"}
    torch.testing.assert_close(loaded["1.weight"], model[0].weight.detach())
    big = torch.arange(10.0)
    export_safetensors({"view": big[2:5], "t": big.view(2, 5).t()}, tmp_path / "v.safetensors")
    loaded = load_file(tmp_path / "v.safetensors")
    assert loaded["view"].tolist() == [2.0, 3.0, 4.0] and loaded["t"].shape == (5, 2)


def test_last_best_and_step_files_fail_one_at_a_time(tmp_path):
    manager = C.CheckpointManager(tmp_path, keep_last=2)
    saved = []
    manager.add_save_hook(saved.append)
    manager.save({"w": torch.tensor([1.0])}, step=1, metric=0.5)
    manager.save({"w": torch.tensor([2.0])}, step=2, metric=0.1)  # mode max: best stays step 1
    assert saved == [tmp_path / "step_00000001.pt", tmp_path / "step_00000002.pt"]
    last, best, step2 = tmp_path / "last.pt", tmp_path / "best.pt", tmp_path / "step_00000002.pt"
    assert last.stat().st_ino != step2.stat().st_ino and last.stat().st_nlink == 1  # copies, not hard links
    assert last.read_bytes() == step2.read_bytes()
    last.write_bytes(last.read_bytes()[:40])  # damage last.pt only
    assert C.load_checkpoint(step2)["w"].item() == 2.0
    assert C.load_checkpoint(best)["w"].item() == 1.0
    with pytest.raises(C.CheckpointReadError, match="cannot read checkpoint"):
        C.load_checkpoint(last)
    assert C.intact_checkpoints(tmp_path) == [best, step2, tmp_path / "step_00000001.pt"]


def test_disk_full_names_the_file_and_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    C.save_checkpoint(tmp_path / "a.pt", {"w": torch.tensor([1.0])})

    def full(_obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C.torch, "save", full)
    with pytest.raises(OSError) as e:
        C.save_checkpoint(tmp_path / "a.pt", {"w": torch.tensor([2.0])})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "a.pt")
    monkeypatch.undo()
    assert C.load_checkpoint(tmp_path / "a.pt")["w"].item() == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]  # no temp file left behind


def test_resuming_from_an_older_step_sets_the_later_branch_aside(tmp_path):
    manager = C.CheckpointManager(tmp_path / "ckpt", keep_last=3)
    for step, metric in ((400, 0.5), (500, 0.9), (600, 0.7)):
        manager.save({"step": step}, step=step, metric=metric)
    assert manager.set_aside_after(600) is None  # a resume from the newest: nothing to move
    folder = manager.set_aside_after(400)
    assert sorted(p.name for p in folder.iterdir()) == ["best.pt", "step_00000500.pt", "step_00000600.pt"]
    assert not (tmp_path / "ckpt" / "best.pt").exists() and "best" not in manager.info
    manager.save({"step": 450}, step=450, metric=0.6)
    manager.save({"step": 460}, step=460, metric=0.4)
    steps = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.pt"))
    assert steps == ["step_00000400.pt", "step_00000450.pt", "step_00000460.pt"]  # one branch only
    assert C.load_checkpoint(tmp_path / "ckpt" / "best.pt")["step"] == 450
