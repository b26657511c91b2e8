"""image_classification with data.streaming (issue #36 item 2): tar shards read in order from a
path or an fsspec URL and a datasets split streamed row by row, split by process, and a
SIGKILLed streamed run that resumes with every logged loss equal to an uninterrupted run's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.data import LoaderSpec, build_loader
from tk.core.errors import TkError
from tk.plugins.image_classification.data import DataConfig
from tk.plugins.image_classification.sources import TarShards, expand_shards
from tk.plugins.image_classification.streams import TarStream, build_stream

from ..kill import kill_when
from .test_image_sources import NAMES, TINY, hf_dataset, picture, write_shards

TK = str(Path(sys.executable).with_name("tk"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("streamed")
    return {"train": write_shards(root, "train", 48, per_shard=12), "val": write_shards(root, "val", 12, per_shard=5)}


def stream_config(shards: dict[str, str], **options) -> DataConfig:
    return DataConfig(source="webdataset", shards=shards, streaming=True, class_names=NAMES, **options)


def expand_urls_first(pattern: str) -> str:
    return str(expand_shards(pattern, "k")[0])


def test_a_streamed_shard_reads_what_random_access_reads_from_any_position(shards):
    stream = TarStream(expand_urls_first(shards["train"]), "data.shards.train")
    indexed = TarShards(expand_shards(shards["train"], "k")[:1], "k", NAMES)
    assert len(stream) == len(indexed) == 12 and stream.top == 2
    for start, stop in ((0, 12), (5, 9), (11, 12), (3, 3)):
        got = list(stream.read(start, stop))
        assert [label for _, label in got] == [indexed[i][1] for i in range(start, stop)]
    assert len(list(stream.read(0, 12))[7][0]) > 0  # the image's bytes


def test_shards_on_an_fsspec_filesystem_stream_like_local_ones(shards):
    """memory:// stands in for s3:// or https:// (any fsspec URL)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    local = expand_shards(shards["val"], "k")
    for path in local:
        fs.pipe(f"/remote/{path.name}", path.read_bytes())
    remote = build_stream(stream_config({"val": "memory://remote/val-{0000..0002}.tar"}), "val", None, NAMES)
    here = build_stream(stream_config(shards), "val", None, NAMES)
    build_loader(remote, LoaderSpec(batch_size=4)), build_loader(here, LoaderSpec(batch_size=4))
    a, b = list(remote), list(here)
    assert len(a) == 12 and [x["labels"] for x in a] == [x["labels"] for x in b]
    assert all(np.array_equal(np.asarray(x["image"]), np.asarray(y["image"])) for x, y in zip(a, b))
    with pytest.raises(TkError, match="data.shards.val: shard memory://remote/missing.tar cannot be opened"):
        build_stream(stream_config({"val": "memory://remote/missing.tar"}), "val", None, NAMES)


def test_two_processes_share_a_streamed_pass(shards):
    """Each rank gets half of the 48 samples (which ones: tests/core/test_stream.py)."""
    labels = []
    for rank in range(2):
        ds = build_stream(stream_config(shards), "train", None, NAMES)
        build_loader(ds, LoaderSpec(batch_size=4, shuffle=True, drop_last=True, seed=0, rank=rank, world_size=2))
        labels += [x["labels"] for x in ds]
    assert sorted(labels) == sorted(i % 3 for i in range(48))


def test_a_hub_split_streams_the_rows_of_the_saved_dataset(tmp_path):
    hf_dataset(10).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(source="hf", hf_name=str(tmp_path / "saved"), hf_split={"train": "train"}, streaming=True)
    ds = build_stream(cfg, "train", None, None)
    build_loader(ds, LoaderSpec(batch_size=4))
    items = list(ds)
    assert ds.classes == NAMES and [x["labels"] for x in items] == [i % 3 for i in range(10)]
    assert np.array_equal(np.asarray(items[4]["image"]), np.asarray(picture(1, 4)))


@pytest.mark.parametrize("override, message", [
    (["data.source=imagefolder", "data.streaming=true"], "data.streaming: data.source imagefolder is read by random"),
    (["data.source=webdataset", "data.shards={train: a.tar, val: b.tar}", "data.streaming=true",
      "data.shuffle_buffer=0"], r"data.shuffle_buffer \(0\) must be >= 1"),
])
def test_streaming_config_problems_are_caught_by_validate(override, message):
    result = CliRunner().invoke(cli, ["validate", "quickstart", *override])
    assert result.exit_code == 2 and re.search(message, result.stderr), result.output


def records(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val/loss")) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("procs, workers", [(1, 2), (2, 0)])
def test_a_sigkilled_streamed_run_resumes_exactly(shards, tmp_path, procs, workers):
    """SIGKILL of the whole run (every process) after step 5's checkpoint, then --resume: every
    logged loss equals an uninterrupted run's, the pass continuing where it stopped."""
    args = ["quickstart", *TINY, "data.source=webdataset", f"data.shards={json.dumps(shards)}",
            "data.streaming=true", "data.shuffle_buffer=10", f"data.class_names={json.dumps(NAMES)}",
            "train.max_steps=30", "train.eval_every=10", "train.log_every=1", f"train.num_workers={workers}",
            "train.deterministic=true"]
    launch = [] if procs == 1 else ["--nproc-per-node", str(procs)]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    done = subprocess.run([TK, "run", *args, f"output_dir={ref}", *launch], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kill_when([TK, "run", *args, f"output_dir={killed}", "train.save_every=1", *launch],
              killed / "checkpoints" / "step_00000006.pt")
    resumed = subprocess.run([TK, "run", *args, f"output_dir={killed}", "--resume", *launch], capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert records(killed) == records(ref) and len(records(ref)) >= 30


def test_pipe_shards_stream_a_commands_output_like_local_ones(shards, tmp_path, monkeypatch):
    """WebDataset's pipe: URLs (e.g. pipe:aws s3 cp s3://bucket/val-0001.tar -): the shard is
    the command's standard output; a failing command is one line with what it said."""
    monkeypatch.setenv("TK_CACHE", str(tmp_path / "cache"))
    folder = Path(expand_urls_first(shards["val"])).parent
    piped = build_stream(stream_config({"val": f"pipe:cat {folder}/val-{{0000..0002}}.tar"}), "val", None, NAMES)
    here = build_stream(stream_config(shards), "val", None, NAMES)
    build_loader(piped, LoaderSpec(batch_size=4)), build_loader(here, LoaderSpec(batch_size=4))
    a, b = list(piped), list(here)
    assert len(a) == 12 and [x["labels"] for x in a] == [x["labels"] for x in b]
    assert all(np.array_equal(np.asarray(x["image"]), np.asarray(y["image"])) for x, y in zip(a, b))
    stream = TarStream(f"pipe:cat {folder}/val-0000.tar", "data.shards.val")
    assert [label for _, label in stream.read(1, 3)] == [label for _, label in TarStream(f"{folder}/val-0000.tar", "k").read(1, 3)]
    chatty = TarStream(f"pipe:head -c 200000 /dev/zero >&2; cat {folder}/val-0000.tar", "k")  # > a pipe's buffer on stderr
    assert [label for _, label in chatty.read(0, 5)] == [label for _, label in stream.read(0, 5)]
    with pytest.raises(TkError, match=r"data.shards.val: cannot read shard pipe:cat /nope/x.tar \(the command "
                                      r"'cat /nope/x.tar' exited with status 1: cat: /nope/x.tar: No such file"):
        build_stream(stream_config({"val": "pipe:cat /nope/x.tar"}), "val", None, NAMES)
    with pytest.raises(TkError, match="is a URL or a pipe: command, read only as a stream; set data.streaming=true"):
        expand_shards("pipe:cat /nope/x.tar", "data.shards.val")


def test_shards_served_over_http_stream_like_local_ones(shards):
    """A real remote protocol: the shards served by a local HTTP server (fsspec's HTTP file
    system, as for https:// shards on a CDN or the hub)."""
    import functools
    import http.server
    import threading

    folder = Path(expand_urls_first(shards["val"])).parent
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/val-{{0000..0002}}.tar"
        remote = build_stream(stream_config({"val": url}), "val", None, NAMES)
        here = build_stream(stream_config(shards), "val", None, NAMES)
        build_loader(remote, LoaderSpec(batch_size=4, num_workers=2)), build_loader(here, LoaderSpec(batch_size=4))
        a, b = list(remote), list(here)
        assert len(a) == 12 and [x["labels"] for x in a] == [x["labels"] for x in b]
        assert all(np.array_equal(np.asarray(x["image"]), np.asarray(y["image"])) for x, y in zip(a, b))
        with pytest.raises(TkError, match=f"data.shards.val: shard http://127.0.0.1:{server.server_port}/nope.tar "
                                          f"cannot be opened"):
            build_stream(stream_config({"val": f"http://127.0.0.1:{server.server_port}/nope.tar"}), "val", None, NAMES)
    finally:
        server.shutdown()


def test_a_url_whose_file_system_is_not_installed_is_one_line():
    pytest.importorskip("fsspec")
    if __import__("importlib").util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(TkError, match=r"data.shards.val: shard gs://bucket/val.tar needs a file system that is not "
                                      r"installed \(.*\); pip install 'tk\[remote\]'"):
        build_stream(stream_config({"val": "gs://bucket/val.tar"}), "val", None, NAMES)
