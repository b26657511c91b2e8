"""Tests for tk.core.metrics: values vs hand computation, and a real 2-process gloo sync."""

import math
import multiprocessing as mp

import pytest
import torch

from tk.core.errors import TkError
from tk.core.metrics import Accuracy, Mean, Metric, MetricCollection
from tk.core.task import StepOutput


class Extremes(Metric):
    """Exercises the max / min / cat reductions."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("hi", torch.tensor(-math.inf), reduce="max")
        self.add_state("lo", torch.tensor(math.inf), reduce="min")
        self.add_state("preds", torch.zeros(0, dtype=torch.long), reduce="cat")
        self.add_state("texts", [], reduce="objects")  # (example id, hypothesis string) pairs

    def keys(self):
        return ["hi", "lo", "preds", "n_preds"]

    def update(self, out, batch):
        self.hi = torch.maximum(self.hi, out.outputs.max())
        self.lo = torch.minimum(self.lo, out.outputs.min())
        self.append("preds", out.outputs.argmax(-1))
        self.extend("texts", [(i, f"pred {p}") for i, p in zip(batch["ids"].tolist(), out.outputs.argmax(-1).tolist())])

    def compute(self):
        return {"hi": float(self.hi), "lo": float(self.lo), "preds": float(self.preds.float().sum()),
                "n_preds": float(self.preds.numel())}


def _data(seed: int = 0, n: int = 8, c: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, generator=g)
    labels = torch.randint(0, c, (n,), generator=g)
    loss = torch.rand(n, generator=g)
    return logits, labels, loss


def _collection():
    return MetricCollection(
        {"acc": Accuracy(topk=(1, 3)), "loss": Mean("loss", "loss"), "nll": Mean("nll", "nll"), "ext": Extremes()},
        prefix="val/",
    )


def _feed(coll, logits, labels, loss, batch_size=2, ids=None):
    ids = torch.arange(len(labels)) if ids is None else ids
    for i in range(0, len(labels), batch_size):
        sl = slice(i, i + batch_size)
        out = StepOutput(loss=loss[sl].sum(), num_items=len(labels[sl]), logs={"nll": 2 * loss[sl].sum()}, outputs=logits[sl])
        coll.update(out, {"labels": labels[sl], "ids": ids[sl]})


def test_accuracy_by_hand():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.15], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    labels = torch.tensor([1, 2, 0, 2])
    acc = Accuracy(topk=(1, 2, 5))
    acc.update(StepOutput(loss=torch.tensor(0.0), num_items=4, outputs=logits), {"labels": labels})
    # top1: only sample 0; top2: samples 0 and 1 (0.15 is 2nd); k=5 clamps to C=3: all
    assert acc.compute() == {"top1": 0.25, "top2": 0.5, "top5": 1.0}
    acc.reset()
    assert math.isnan(acc.compute()["top1"])


def test_token_accuracy_ignore_index_and_soft_targets():
    logits = torch.zeros(2, 3, 4)
    logits[..., 1] = 1.0  # always predicts class 1
    tgt = torch.tensor([[1, 1, 0], [2, 0, 0]])  # 0 = PAD
    acc = Accuracy(target_key="tgt", ignore_index=0)
    acc.update(StepOutput(loss=torch.tensor(0.0), num_items=3, outputs={"logits": logits}), {"tgt": tgt})
    assert acc.compute()["top1"] == pytest.approx(2 / 3)
    soft = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.6, 0.4, 0.0, 0.0]])
    acc2 = Accuracy()
    acc2.update(StepOutput(loss=torch.tensor(0.0), num_items=2, outputs=logits[0, :2]), {"labels": soft})
    assert acc2.compute()["top1"] == 0.5
    with pytest.raises(TkError, match="labels"):
        acc2.update(StepOutput(loss=torch.tensor(0.0), num_items=2, outputs=logits[0, :2]), {"y": soft})


def test_mean_and_collection_prefix():
    logits, labels, loss = _data()
    coll = _collection()
    _feed(coll, logits, labels, loss, batch_size=3)
    coll.sync()  # no process group: no-op
    res = coll.compute()
    assert res["val/loss"] == pytest.approx(loss.mean().item())
    assert res["val/nll"] == pytest.approx(2 * loss.mean().item())
    assert res["val/top1"] == (logits.argmax(-1) == labels).float().mean().item()
    assert res["val/hi"] == pytest.approx(logits.max().item()) and res["val/n_preds"] == 8
    # two metrics declaring one key: refused when the collection is built (before any data)
    with pytest.raises(TkError, match=r"metrics 'a' \(Accuracy\) and 'b' \(Accuracy\) both return 'val/top1'"):
        MetricCollection({"a": Accuracy(), "b": Accuracy(topk=(1, 5))}, prefix="val/")
    assert coll.keys() == ["val/top1", "val/top3", "val/hi", "val/lo", "val/preds", "val/n_preds", "val/loss",
                           "val/nll"]


def test_undeclared_result_key_is_an_error():
    class Sneaky(Mean):
        def compute(self):
            return {**super().compute(), "extra": 1.0}

    coll = MetricCollection({"s": Sneaky("x", "loss")})
    with pytest.raises(TkError, match=r"returned \['extra'\] but its keys\(\) declare \['x'\]"):
        coll.compute()


def _worker(rank: int, world: int, init_file: str, queue) -> None:
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        logits, labels, loss = _data()
        # interleaved, unequal shards (as ShardSampler deals them): exercises cat padding and
        # the dataset-order merge of object states
        idx = torch.tensor([0, 2, 4, 6, 7]) if rank == 0 else torch.tensor([1, 3, 5])
        coll = _collection()
        _feed(coll, logits[idx], labels[idx], loss[idx], ids=idx)
        coll.sync()
        coll.sync()  # idempotent
        queue.put((rank, (coll.compute(), coll.metrics["ext"].texts)))
    finally:
        torch.distributed.destroy_process_group()


def test_sync_two_gloo_processes_equals_single_process(tmp_path):
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    single = _collection()
    logits, labels, loss = _data()
    _feed(single, logits, labels, loss)
    expected = single.compute()
    in_order = [(i, f"pred {p}") for i, p in enumerate(logits.argmax(-1).tolist())]
    assert single.metrics["ext"].texts == in_order
    for rank in (0, 1):
        values, texts = results[rank]
        assert values.keys() == expected.keys()
        for k, v in expected.items():
            assert values[k] == pytest.approx(v), k
        assert texts == in_order  # both processes hold every example's object, in dataset order


def test_metrics_write_into_a_created_eval_folder_and_a_failing_one_is_named(tmp_path):
    import warnings as _warnings

    from tk.core.metrics import Mean, MetricCollection
    from tk.core.step import EvalContext

    class Table(Mean):
        def write(self, out_dir, ctx):
            (out_dir / "table.txt").write_text("ok")

    class Broken(Mean):
        def write(self, out_dir, ctx):
            raise ValueError("no plot backend")

    metrics = MetricCollection({"broken": Broken("b", "loss"), "table": Table("t", "loss")})
    out = tmp_path / "run" / "eval"  # not there yet
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        metrics.write(out, EvalContext("val"))
    assert (out / "table.txt").read_text() == "ok"
    assert [str(w.message) for w in caught] == [
        f"metric 'broken' (Broken) could not write its files into {out}: ValueError: no plot backend"]
