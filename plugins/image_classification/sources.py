"""Image sources beyond folders: a Hugging Face ``datasets`` dataset (hub id, ``save_to_disk``
folder, parquet or imagefolder builder with local files) and WebDataset tar shards.

Both are map-style datasets (``len``, ``__getitem__``, ``classes``), so the engine's samplers
split them by process and resume them exactly like the other sources. Tar shards are read by
random access: their member offsets are indexed once (headers only, no image decoded), as
webdataset's ``wids`` does.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from braceexpand import braceexpand
from PIL import Image
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.core.text.hub import load_hub_dataset

log = logging.getLogger(__name__)

__all__ = ["HubImages", "TarShards", "expand_shards"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # WebDataset keys tried for the image, in order
_SPLIT_HELP = "data.hf_split maps tk's splits to the dataset's, e.g. {train: train, val: validation}"


class HubImages(Dataset):
    """One split of an image ``datasets`` dataset, as ``(image, label)`` pairs.

    Args:
        name: hub id, ``save_to_disk`` folder, or a builder (``parquet``, ``imagefolder``) with ``data_files``.
        config: the dataset's config; None = its default.
        split: the dataset's split name.
        image_column, label_column: the columns with the image and the integer label.
        data_files: split -> local files for a builder.
        class_names: names of the labels in order; None = the label column's ``ClassLabel`` names.
        transform: applied to each RGB PIL image.
    """

    def __init__(self, name: str, config: str | None, split: str, image_column: str, label_column: str,
                 data_files: dict[str, Any] | None = None, class_names: Sequence[str] | None = None,
                 transform: Callable | None = None) -> None:
        self.ds = load_hub_dataset(name, config, split, data_files=data_files,
                                   columns={image_column: "data.image_column", label_column: "data.label_column"},
                                   split_key="data.hf_split", local="data.source: imagefolder or webdataset")
        self.image_column, self.label_column, self.transform = image_column, label_column, transform
        feature = self.ds.features[label_column]
        if class_names is not None:
            self.classes = list(class_names)
        elif hasattr(feature, "names"):  # a ClassLabel
            self.classes = list(feature.names)
        else:
            raise TkError(f"data.label_column: {label_column!r} of {name!r} is not a ClassLabel column (it is "
                          f"{feature}), so the class names are unknown; list them in data.class_names")
        if type(self.ds.features[image_column]).__name__ != "Image":  # datasets.Image decodes to PIL
            raise TkError(f"data.image_column: {image_column!r} of {name!r} is not an Image column "
                          f"(it is {self.ds.features[image_column]}); set data.image_column")

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        row = self.ds[index]
        label = int(row[self.label_column])
        if not 0 <= label < len(self.classes):
            raise TkError(f"data.label_column: row {index} has label {label}, outside the {len(self.classes)} "
                          f"classes; check data.class_names")
        image = row[self.image_column].convert("RGB")
        return (self.transform(image) if self.transform else image), label


def expand_shards(pattern: str | Sequence[str], key: str) -> list[Path]:
    """The tar files of a brace pattern (``train-{0000..0099}.tar``) or a list of them.

    Raises:
        TkError: a shard that does not exist (naming the first and how many are missing).
    """
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    paths = [Path(p).expanduser() for pat in patterns for p in braceexpand(pat)]
    remote = next((p for pat in patterns for p in braceexpand(pat) if "://" in p or p.startswith("pipe:")), None)
    if remote is not None:
        raise TkError(f"{key}: {remote!r} is a URL or a pipe: command, read only as a stream; set data.streaming=true "
                      f"(or give local .tar files)")
    missing = [p for p in paths if not p.is_file()]
    if not paths or missing:
        first = missing[0] if missing else patterns
        raise TkError(f"{key}: {len(missing) or 'no'} shard(s) of {patterns} not found (first: {first}); give local "
                      f".tar files, e.g. {key}=data/train-{{0000..0009}}.tar")
    return paths


class TarShards(Dataset):
    """WebDataset tar shards as ``(image, label)`` pairs: the members of a sample share a key
    (the path up to the first dot of the file name); the image is its ``.jpg``/``.png``/
    ``.webp``, the label its ``.cls`` (an integer) or the ``label`` of its ``.json``.

    Args:
        shards: the tar files, in order (samples are numbered across them).
        key: the recipe key named in errors.
        class_names: names of the labels in order; None = ``"0"``, ``"1"``, ... up to the largest label.
        transform: applied to each RGB PIL image.
        on_bad_image: an image that does not decode: "error" (one line naming shard and member) or "skip"
            (warned once, counted in ``bad_members``, replaced by the next readable sample, as image folders do).
    """

    def __init__(self, shards: Sequence[Path], key: str, class_names: Sequence[str] | None = None,
                 transform: Callable | None = None, on_bad_image: str = "error") -> None:
        self.shards, self.key, self.transform, self.on_bad_image = list(shards), key, transform, on_bad_image
        self.bad_members: set[str] = set()
        # (shard, (offset, size) of the image, label, its member's name)
        self.samples: list[tuple[int, tuple[int, int], int, str]] = []
        for n, shard in enumerate(self.shards):
            self.samples += self._index(n, shard)
        if not self.samples:
            raise TkError(f"{key}: the shards hold no sample with an image ({'/'.join(IMAGE_EXTENSIONS)}) and a "
                          f"label (.cls or .json); write them with webdataset's TarWriter")
        top = max(sample[2] for sample in self.samples)
        self.classes = list(class_names) if class_names is not None else [str(i) for i in range(top + 1)]
        if top >= len(self.classes) or min(sample[2] for sample in self.samples) < 0:
            raise TkError(f"data.class_names: the shards hold label {top} but {len(self.classes)} class names are "
                          f"given; list one name per label 0..{top}")
        self._files: dict[int, Any] = {}  # open shards, per process (a loader worker opens its own)

    def _index(self, n: int, shard: Path) -> list[tuple[int, tuple[int, int], int]]:
        groups: dict[str, dict[str, tarfile.TarInfo]] = {}
        try:
            with tarfile.open(shard) as tar:
                for member in tar:
                    if member.isfile():
                        folder, _, name = member.name.rpartition("/")
                        stem, _, ext = name.partition(".")
                        groups.setdefault(f"{folder}/{stem}", {})[ext.lower()] = member
                check_complete(tar, shard, self.key)
                labels = {k: _label(tar, lm, shard) for k, ms in groups.items() if (lm := _label_member(ms)) is not None}
        except (tarfile.TarError, OSError, EOFError) as e:
            raise TkError(f"{self.key}: cannot read shard {shard} ({e}); it is damaged or not a tar file") from e
        out = []
        for k, members in groups.items():
            image = next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)
            if image is not None and k in labels:
                out.append((n, (image.offset_data, image.size), labels[k], image.name))
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        for step in range(len(self.samples)):  # skip policy: the next readable sample keeps batch shapes
            shard, (offset, size), label, member = self.samples[(index + step) % len(self.samples)]
            f = self._files.get(shard)
            if f is None:
                f = self._files[shard] = open(self.shards[shard], "rb")
            f.seek(offset)
            try:
                image = Image.open(io.BytesIO(f.read(size))).convert("RGB")
            except Exception as e:  # PIL raises several types
                where = f"{self.shards[shard]}:{member}"
                if self.on_bad_image == "error":
                    raise TkError(f"{self.key}: cannot read image {where} ({e}); rewrite the shard, or set "
                                  f"data.on_bad_image=skip to skip unreadable images") from e
                if where not in self.bad_members:
                    self.bad_members.add(where)
                    log.warning("skipping unreadable image %s (%s); %d skipped so far", where, e,
                                len(self.bad_members))
                continue
            return (self.transform(image) if self.transform else image), label
        raise TkError(f"{self.key}: no image of the shards decodes ({len(self.bad_members)} tried)")

    def __getstate__(self) -> dict[str, Any]:  # loader workers: open their own files
        return {**self.__dict__, "_files": {}}


def check_complete(tar: tarfile.TarFile, shard: Any, key: str) -> None:
    """After reading every member: a shard cut at a member boundary ends without tar's end-of-archive
    block, and tarfile stops there without a word (fewer samples, silently); here it is an error.

    Raises:
        TkError: the shard is truncated, named with its size.
    """
    fileobj = tar.fileobj
    read = fileobj.pos if hasattr(fileobj, "pos") else fileobj.tell()  # a stream's bytes read, or a file's position
    if read < tar.offset + tarfile.BLOCKSIZE:
        raise TkError(f"{key}: shard {shard} ends after {tar.offset:,} bytes without tar's end-of-archive block: "
                      f"it is truncated (an interrupted copy or download), so samples are missing; write or fetch "
                      f"it again")


def _label_member(members: dict[str, tarfile.TarInfo]) -> tarfile.TarInfo | None:
    return members.get("cls") or members.get("json")


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo, shard: Path) -> int:
    return parse_label(tar.extractfile(member).read(), member.name, shard)


def parse_label(raw: bytes, member: str, shard: Any) -> int:
    """A sample's label: the integer of its ``.cls``, or the ``label`` of its ``.json``.

    Raises:
        TkError: anything else, naming the shard and member.
    """
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        value = json.loads(text)
        value = value["label"] if isinstance(value, dict) else value
        return int(value)
    except (ValueError, KeyError, TypeError):
        raise TkError(f"shard {shard}: {member} holds {text[:40]!r}, not an integer label (.cls: the label; "
                      f".json: {{\"label\": N}})") from None
