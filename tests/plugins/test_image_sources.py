"""image_classification's data.source hf (a datasets dataset: save_to_disk folder, parquet) and
webdataset (tar shards), on data the tests write (issue #36 item 1)."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from tk.core.cli import cli
from tk.core.errors import TkError
from tk.plugins.image_classification.sources import TarShards, expand_shards

TINY = ["model.dim=16", "model.depth=1", "model.num_heads=2", "model.patch_size=4", "data.img_size=16",
        "train.max_steps=4", "train.batch_size=4", "train.eval_batch_size=4", "train.eval_every=2",
        "train.progress=false"]
NAMES = ["red", "green", "blue"]


def picture(label: int, i: int) -> Image.Image:
    colour = [0, 0, 0]
    colour[label] = 120 + 40 * (i % 3)
    return Image.new("RGB", (20, 20), tuple(colour))


def hf_dataset(n: int):
    import datasets

    labels = [i % 3 for i in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    return datasets.Dataset.from_dict({"image": [picture(lab, i) for i, lab in enumerate(labels)], "label": labels},
                                      features=features)


def write_shards(folder, prefix: str, n: int, per_shard: int, json_label: bool = False) -> str:
    """WebDataset shards written by webdataset's own TarWriter; returns the brace pattern."""
    import webdataset as wds

    folder.mkdir(exist_ok=True)
    shards = (n + per_shard - 1) // per_shard
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{prefix}-{s:04d}.tar")) as sink:
            for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
                buf = io.BytesIO()
                picture(i % 3, i).save(buf, format="PNG")
                label = {"json": json.dumps({"label": i % 3}).encode()} if json_label else {"cls": str(i % 3).encode()}
                sink.write({"__key__": f"sample{i:05d}", "png": buf.getvalue(), **label})
    return str(folder / f"{prefix}-{{0000..{shards - 1:04d}}}.tar")


def test_tar_shards_index_every_sample_and_read_it_back(tmp_path):
    pattern = write_shards(tmp_path, "train", 10, per_shard=4)
    shards = expand_shards(pattern, "data.shards.train")
    assert [p.name for p in shards] == ["train-0000.tar", "train-0001.tar", "train-0002.tar"]
    ds = TarShards(shards, "data.shards.train", NAMES)
    assert len(ds) == 10 and ds.classes == NAMES
    for i in (0, 5, 9):
        image, label = ds[i]
        assert label == i % 3 and np.array_equal(np.asarray(image), np.asarray(picture(i % 3, i)))
    json_labels = TarShards(expand_shards(write_shards(tmp_path, "j", 4, 4, json_label=True), "k"), "k")
    assert [json_labels[i][1] for i in range(4)] == [0, 1, 2, 0] and json_labels.classes == ["0", "1", "2"]
    import pickle

    again = pickle.loads(pickle.dumps(ds))  # a loader worker's copy opens its own files
    assert again[3][1] == ds[3][1]


def test_tar_shard_problems_are_one_line(tmp_path):
    with pytest.raises(TkError, match=r"data.shards.train: 1 shard\(s\) of .* not found"):
        expand_shards(str(tmp_path / "train-{0000..0000}.tar"), "data.shards.train")
    (tmp_path / "bad.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(TkError, match="cannot read shard .*bad.tar"):
        TarShards([tmp_path / "bad.tar"], "data.shards.train")
    with tarfile.open(tmp_path / "odd.tar", "w") as tar:
        for name, data in (("a.png", b"x"), ("a.cls", b"cat")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(TkError, match="a.cls holds 'cat', not an integer label"):
        TarShards([tmp_path / "odd.tar"], "data.shards.train")
    pattern = write_shards(tmp_path, "t", 6, 6)
    with pytest.raises(TkError, match="hold label 2 but 2 class names"):
        TarShards(expand_shards(pattern, "k"), "k", ["a", "b"])


def test_a_shard_cut_between_members_is_an_error_not_fewer_samples(tmp_path):
    """#51 item 8: tarfile stops without a word where a shard was cut at a member boundary (18 of 32
    samples); indexed and streamed alike it is one line naming the shard."""
    from tk.plugins.image_classification.streams import TarStream

    write_shards(tmp_path, "train", 32, per_shard=32)
    shard = tmp_path / "train-0000.tar"
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[36].offset  # the header of sample 18
    assert len(TarShards([shard], "k", NAMES)) == 32 and sum(1 for _ in TarStream(str(shard), "k").read(0, 99)) == 32
    shard.write_bytes(shard.read_bytes()[:cut])
    with pytest.raises(TkError, match=f"k: shard .*train-0000.tar ends after {cut:,} bytes without tar's end-of-archive"):
        TarShards([shard], "k", NAMES)
    with pytest.raises(TkError, match="train-0000.tar ends after .* it is truncated"):
        list(TarStream(str(shard), "k").read(0, 99))


@pytest.mark.slow
def test_webdataset_run_trains_evaluates_and_predicts(tmp_path):
    train = write_shards(tmp_path / "shards", "train", 24, per_shard=8)
    val = write_shards(tmp_path / "shards", "val", 6, per_shard=6)
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "quickstart", "data.source=webdataset",
                                      f"data.shards={{train: '{train}', val: '{val}'}}",
                                      f"data.class_names={NAMES}", f"output_dir={out}", *TINY])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "artifacts" / "classes.json").read_text()) == NAMES
    assert "image_classification: val: 6 images" in (out / "train.log").read_text()  # each split's size, said
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val/top1" in r for r in rows)
    picture(1, 0).save(tmp_path / "green.png")
    predicted = CliRunner().invoke(cli, ["predict", str(out), str(tmp_path / "green.png")])
    assert predicted.exit_code == 0 and json.loads(predicted.stdout)["top_k"][0]["label"] in NAMES


@pytest.mark.slow
def test_hf_image_dataset_from_a_saved_folder_and_from_parquet(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": hf_dataset(24), "validation": hf_dataset(6)})
    dd.save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "quickstart", "data.source=hf", f"data.hf_name={tmp_path / 'saved'}",
                                      f"output_dir={out}", *TINY])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "artifacts" / "classes.json").read_text()) == NAMES  # the ClassLabel's names

    dd["train"].to_parquet(str(tmp_path / "train.parquet"))
    dd["validation"].to_parquet(str(tmp_path / "val.parquet"))
    files = f"{{train: '{tmp_path / 'train.parquet'}', validation: '{tmp_path / 'val.parquet'}'}}"
    result = CliRunner().invoke(cli, ["run", "quickstart", "data.source=hf", "data.hf_name=parquet",
                                      f"data.hf_data_files={files}", f"output_dir={tmp_path / 'pq'}", *TINY])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "pq" / "artifacts" / "classes.json").read_text()) == NAMES


def test_hf_image_items_equal_the_dataset(tmp_path):
    from tk.plugins.image_classification.sources import HubImages

    hf_dataset(6).save_to_disk(str(tmp_path / "saved"))
    ds = HubImages(str(tmp_path / "saved"), None, "train", "image", "label")
    assert len(ds) == 6 and ds.classes == NAMES
    image, label = ds[4]
    assert label == 1 and np.array_equal(np.asarray(image), np.asarray(picture(1, 4)))
    with pytest.raises(TkError, match="data.image_column: 'img' .* has no column|has no column 'img'"):
        HubImages(str(tmp_path / "saved"), None, "train", "img", "label")


@pytest.mark.parametrize("override, message", [
    ("data.source=hf", "data.hf_name: data.source hf needs a dataset"),
    ("data.source=webdataset", "data.shards: data.source webdataset needs the train and val shards"),
    ("data.shards={train: a.tar, dev: b.tar}", "keys ['dev'] are not tk splits"),
    ("data.class_names=[a, a]", "names repeat"),
])
def test_source_config_problems_are_caught_by_validate(override, message):
    result = CliRunner().invoke(cli, ["validate", "quickstart", override])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_image_batches_are_the_same_through_every_source(tmp_path):
    """The same pictures through webdataset and hf give the same normalised tensors (one transform path)."""
    from tk.core.recipe import load_config
    from tk.plugins.image_classification.data import build_source_dataset

    pattern = write_shards(tmp_path, "train", 6, 6)
    hf_dataset(6).save_to_disk(str(tmp_path / "saved"))
    cfg, _ = load_config("quickstart", [f"data.shards={{train: '{pattern}', val: '{pattern}'}}",
                                        f"data.hf_name={tmp_path / 'saved'}", "data.hf_split={train: train}",
                                        f"data.class_names={NAMES}"])
    import dataclasses

    from torchvision.transforms import functional as F

    wds_ds = build_source_dataset(dataclasses.replace(cfg.sections["data"], source="webdataset"), "train", F.to_tensor)
    hf_ds = build_source_dataset(dataclasses.replace(cfg.sections["data"], source="hf"), "train", F.to_tensor)
    for i in range(6):
        assert torch.equal(wds_ds[i][0], hf_ds[i][0]) and wds_ds[i][1] == hf_ds[i][1]


@pytest.mark.slow
def test_the_food101_recipe_runs_on_a_local_stand_in(tmp_path):
    """recipes/vit_finetune_food101.yaml with its hub dataset replaced by a save_to_disk folder
    and its hub weights by a timm weights file: the paths a user without network takes."""
    import datasets
    import timm
    from safetensors.torch import save_file

    datasets.DatasetDict({"train": hf_dataset(8), "validation": hf_dataset(4)}).save_to_disk(str(tmp_path / "food"))
    save_file(timm.create_model("vit_tiny_patch16_224").state_dict(), str(tmp_path / "vit.safetensors"))
    result = CliRunner().invoke(cli, ["run", "vit_finetune_food101", f"data.hf_name={tmp_path / 'food'}",
                                      "model.pretrained=false", f"model.pretrained_from={tmp_path / 'vit.safetensors'}",
                                      "data.img_size=32", "train.max_steps=2", "train.batch_size=4",
                                      "train.eval_batch_size=4", "train.num_workers=0", "train.precision=fp32",
                                      "train.progress=false", "mixup.prob=0.0", f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "artifacts" / "classes.json").read_text()) == NAMES


def test_a_corrupt_image_in_a_shard_names_shard_and_member_and_honours_the_skip_policy(tmp_path, caplog):
    """#51 item 8: not "<_io.BytesIO object at 0x...>", and data.on_bad_image=skip skips it (indexed shards)."""
    import webdataset as wds

    shard = tmp_path / "train-0000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i in range(4):
            buf = io.BytesIO()
            picture(i % 3, i).save(buf, format="PNG")
            sink.write({"__key__": f"s{i}", "png": b"not a png" if i == 1 else buf.getvalue(), "cls": str(i % 3).encode()})
    with pytest.raises(TkError, match=r"k: cannot read image .*train-0000.tar:s1.png .* data.on_bad_image=skip"):
        TarShards([shard], "k", NAMES)[1]
    skipping = TarShards([shard], "k", NAMES, on_bad_image="skip")
    with caplog.at_level("WARNING"):
        image, label = skipping[1]  # the next readable sample, s2
    assert label == 2 and skipping.bad_members == {f"{shard}:s1.png"}
    assert any("skipping unreadable image" in r.getMessage() for r in caplog.records)
