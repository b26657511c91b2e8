"""train.loggers: TensorBoard event files hold exactly metrics.jsonl's scalars (also
after SIGKILL + resume), W&B offline writes a run with the config and the metrics, a
logger without its package fails validation with the install line, media reach the
run dir and TensorBoard."""

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.media import Image, Text
from tk.core.run.loggers import TensorBoardLogger, scalars
from tk.core.run.runlog import RunLog

TK = str(Path(sys.executable).with_name("tk"))


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def event_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's scalars as TensorBoard stores them (float32)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in jsonl(run_dir):
        for name, value in scalars(record).items():
            out.setdefault(name, []).append((record["step"], float(np.float32(value))))
    return out


def test_scalar_names_put_training_keys_under_train():
    record = {"step": 5, "epoch": 0.5, "split": "train", "loss": 1.5, "lr": 0.1, "acc": 0.25, "items_seen": 80.0,
              "time": 2.0, "loss_scale": None}
    assert scalars(record) == {"epoch": 0.5, "train/loss": 1.5, "train/lr": 0.1, "train/acc": 0.25,
                               "items_seen": 80.0, "time": 2.0}
    val = {"step": 5, "epoch": 0.5, "split": "val", "val/loss": 1.0, "val_ema/top1": 0.5, "time": 2.5}
    assert scalars(val) == {"val/loss": 1.0, "val_ema/top1": 0.5}  # x-axis values from training records only


def test_tensorboard_events_equal_metrics_jsonl(toy_site, toy_recipe, tmp_path):
    run_dir = tmp_path / "tb"
    result = invoke("run", toy_recipe, f"output_dir={run_dir}", "train.loggers=[tensorboard]", "train.log_every=5",
                    "train.ema_decay=0.9")
    assert result.exit_code == 0, result.output
    events, expected = event_scalars(run_dir / "tensorboard"), expected_scalars(run_dir)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/items_per_s", "train/skipped_steps", "val/loss",
            "val/top1", "val_ema/top1"} <= set(expected)
    assert events == expected
    assert len(events["train/loss"]) == 8 and [s for s, _ in events["val/top1"]] == [20, 40]
    assert not (run_dir / "metrics.csv").exists()  # csv is not in the list; metrics.jsonl always is


def test_tensorboard_resume_purges_the_killed_runs_later_points(tmp_path):
    log_dir = tmp_path / "tensorboard"
    first = TensorBoardLogger(log_dir)
    for step in range(1, 11):  # the killed run got to step 10, its last checkpoint was step 6
        first.log({"step": step, "split": "train", "loss": 1.0})
    first.close()
    # the killed run's file as a faster machine names it: created this second, by a later pid on a
    # host name that sorts last; the resumed file must still be read after it
    (killed,) = log_dir.glob("events.out.tfevents.*")
    killed.rename(log_dir / f"events.out.tfevents.{int(time.time()):010d}.zzzz.99999999.0")
    resumed = TensorBoardLogger(log_dir, resumed_at=6)
    for step in range(7, 13):
        resumed.log({"step": step, "split": "train", "loss": 2.0})
    resumed.close()
    assert event_scalars(log_dir)["train/loss"] == [(s, 1.0) for s in range(1, 7)] + [(s, 2.0) for s in range(7, 13)]


@pytest.mark.slow
def test_sigkill_and_resume_leave_no_duplicate_step(toy_site, tmp_path):
    recipe = tmp_path / "tokens.yaml"
    recipe.write_text("task: toy_tokens\ndata: {num_train: 192, num_val: 32, delay: 0.05}\noptim: {lr: 0.01}\n"
                      "train: {max_steps: 20, batch_size: 16, eval_every: 7, log_every: 1, save_every: 1, "
                      "progress: false, loggers: [jsonl, tensorboard]}\n")
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(toy_site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([TK, "run", str(recipe), f"output_dir={run_dir}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step_00000011.pt").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "running" and status["pid"] == proc.pid  # `tk runs` sees the dead pid
    result = invoke("run", recipe, f"output_dir={run_dir}", "--resume")
    assert result.exit_code == 0, result.output
    events = event_scalars(run_dir / "tensorboard")
    steps = [s for s, _ in events["train/loss"]]
    assert steps == list(range(1, 21))  # each step once, none missing
    assert events == expected_scalars(run_dir)
    assert len(glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))) == 2  # the same dir, continued
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


def wandb_records(run_file: str):
    """The protobuf records of a ``.wandb`` file (a LevelDB-style log: 7-byte file header,
    32 KiB blocks of [crc32, length, type] chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, partial = Path(run_file).read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(partial)
            records.append(record)
    return records


@pytest.mark.slow
def test_wandb_offline_writes_the_config_and_the_metrics(toy_site, toy_recipe, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "wb"
    result = invoke("run", toy_recipe, f"output_dir={run_dir}", "train.loggers=[jsonl,wandb]", "train.log_every=10",
                    "train.wandb_project=tk-tests", "train.wandb_name=toy-run")
    assert result.exit_code == 0, result.output
    run_id = json.loads((run_dir / "wandb.json").read_text())["id"]
    (run_file,) = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    deadline = time.monotonic() + 60
    records = wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "W&B never finished writing the run file"  # its service writes it
        time.sleep(0.2)
        records = wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "tk-tests" and run.display_name == "toy-run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["task"] == "toy" and config["train"]["max_steps"] == 40 and config["train"]["loggers"] == ["jsonl",
                                                                                                        "wandb"]
    history: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                   for item in r.history.item}
            history[r.history.step.num] = row
    for record in jsonl(run_dir):
        for name, value in scalars(record).items():
            assert history[record["step"]][name] == pytest.approx(value, rel=1e-12), name
    assert sorted(history) == [10, 20, 30, 40]


def test_missing_logger_package_fails_validation_with_the_install_line(toy_site, toy_recipe, tmp_path, monkeypatch):
    trained = tmp_path / "runs" / "trained"  # a run made where tensorboard is installed ...
    assert invoke("run", toy_recipe, f"output_dir={trained}", "train.loggers=[jsonl,tensorboard]").exit_code == 0
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # ... then a machine without it
    run_dir = tmp_path / "never"
    result = invoke("run", toy_recipe, f"output_dir={run_dir}", "train.loggers=[csv,tensorboard]")
    assert result.exit_code == 2
    assert "train.loggers: 'tensorboard' needs the tensorboard package" in result.stderr
    assert "pip install 'tk[tensorboard]'" in result.stderr
    assert not run_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["runs", "site", "toy.yaml"]
    checked = invoke("validate", toy_recipe, "train.loggers=[tensorboard]")
    assert checked.exit_code == 2 and "pip install 'tk[tensorboard]'" in checked.stderr
    # evaluating the finished run needs no logger package
    assert invoke("eval", str(trained), "--checkpoint", "last").exit_code == 0


def test_media_go_to_the_run_dir_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path)
    log.add_loggers([TensorBoardLogger(tmp_path / "tensorboard")])
    pixels = np.zeros((8, 12, 3), dtype=np.uint8)
    pixels[:, :6, 0] = 255
    log.media([Image("val/samples", pixels), Text("val/translations", "a -> b\nc -> d")], step=7)
    log.close()
    from PIL import Image as PILImage

    saved = np.asarray(PILImage.open(tmp_path / "media" / "val_samples_step_00000007.png"))
    assert np.array_equal(saved, pixels)
    assert (tmp_path / "media" / "val_translations_step_00000007.txt").read_text() == "a -> b\nc -> d"
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    (event,) = acc.Images("val/samples")
    assert event.step == 7 and (event.width, event.height) == (12, 8)
    assert "val/translations/text_summary" in acc.Tags()["tensors"]


@pytest.mark.slow
def test_image_plugin_logs_a_grid_of_validation_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tk.plugins.image_classification.samples import CAPTION, TILE

    run_dir = tmp_path / "qs"
    result = invoke("run", "quickstart", f"output_dir={run_dir}", "data.num_train=64", "data.num_val=32",
                    "model.depth=1", "model.dim=32", "train.max_steps=2", "train.eval_every=1", "train.batch_size=8",
                    "train.eval_batch_size=16", "train.progress=false", "train.loggers=[tensorboard]")
    assert result.exit_code == 0, result.output
    grids = sorted(p.name for p in (run_dir / "media").iterdir())
    assert grids == ["val_samples_step_00000001.png", "val_samples_step_00000002.png"]  # each evaluation
    from PIL import Image as PILImage

    grid = PILImage.open(run_dir / "media" / grids[-1])
    assert grid.size == (8 * TILE, 2 * (TILE + CAPTION))  # 16 images, 8 per row
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("val/samples")] == [1, 2]
    standalone = invoke("eval", run_dir)  # tk eval makes no media
    assert standalone.exit_code == 0 and len(list((run_dir / "media").iterdir())) == 2


def test_wandb_resume_keeps_the_run_id_and_sends_no_step_twice(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from tk.core.config import RunConfig, TrainConfig
    from tk.core.run.loggers import WandbLogger

    sent, inits = [], []

    class FakeRun:
        def __init__(self, **kwargs):
            inits.append(kwargs)
            self.id = kwargs["id"]

        def log(self, values, step):
            sent.append((step, values))

        def finish(self):
            pass

    fake = SimpleNamespace(init=lambda **kw: FakeRun(**kw), Settings=lambda **kw: kw, Image=None, Html=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = RunConfig("toy", {}, None, None, TrainConfig(loggers=["wandb"], wandb_project="p"), str(tmp_path))
    cfg.to_dict = lambda: {"task": "toy"}
    first = WandbLogger(cfg, tmp_path)
    for step in range(1, 11):  # killed at step 10; its last checkpoint was step 6
        first.log({"step": step, "split": "train", "loss": 1.0})
    resumed = WandbLogger(cfg, tmp_path, resumed_at=6)
    for step in range(7, 13):
        resumed.log({"step": step, "split": "train", "loss": 2.0})
    assert inits[1]["id"] == inits[0]["id"] and inits[1]["resume"] == "allow" and inits[0]["project"] == "p"
    assert inits[0]["config"] == {"task": "toy"}
    assert [s for s, _ in sent] == list(range(1, 13))  # 7..10 not sent again
    assert sent[-1] == (12, {"train/loss": 2.0})
    # --resume-from an earlier checkpoint abandons steps 5..12: a new W&B run gets all of the new ones
    sent.clear()
    rewound = WandbLogger(cfg, tmp_path, resumed_at=4, rewound=True)
    for step in range(5, 8):
        rewound.log({"step": step, "split": "train", "loss": 3.0})
    assert inits[2]["id"] != inits[0]["id"] and [s for s, _ in sent] == [5, 6, 7]
    assert json.loads((tmp_path / "wandb.json").read_text()) == {"id": inits[2]["id"], "last_step": 7}
    WandbLogger(cfg, tmp_path)  # a fresh run (no resume) gets a new id
    assert inits[2]["id"] != inits[0]["id"]
