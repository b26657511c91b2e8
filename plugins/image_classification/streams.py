"""Streamed image sources (``data.streaming: true``): WebDataset tar shards read sequentially
from a local path, any fsspec URL (``s3://``, ``gs://``, ``https://``) or the standard output
of a shell command (WebDataset's ``pipe:aws s3 cp s3://bucket/train-0001.tar -``),
and a ``datasets`` image dataset streamed from the hub (or a local ``save_to_disk`` folder),
as a :class:`tk.core.data.stream.StreamingDataset`: split by process and loader worker,
resumed at the batch where a run stopped.

A streamed source must know its sample count (every process takes an equal share): a tar
shard's count and largest label come from one pass over its headers and labels, cached in
``$TK_CACHE/shards`` under the shard's URL, size and modification time (a ``pipe:`` shard's
under its command alone: delete the cache entry when its output changes); a hub split's count
from the dataset's metadata.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from braceexpand import braceexpand
from PIL import Image

from tk.core.data.stream import StreamingDataset
from tk.core.errors import TkError
from tk.core.text.hub import load_hub_dataset
from tk.core.text.token_store import cache_root
from tk.plugins.image_classification.sources import IMAGE_EXTENSIONS, check_complete, parse_label

__all__ = ["HubImageStream", "TarStream", "build_stream"]

_LABEL_EXTENSIONS = ("cls", "json")
PIPE = "pipe:"  # WebDataset's prefix of a shard read from a shell command's standard output


def _open(url: str):
    if url.startswith(PIPE):
        return _Pipe(url[len(PIPE):])
    import fsspec  # a dependency of datasets

    return fsspec.open(url, "rb").open()


class _Pipe:
    """The standard output of a ``pipe:`` shard's shell command, read as a file; a command that
    fails (exit status above 0) is an ``OSError`` with the last line it wrote to stderr. A reader
    that stops before the end stops the command."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.stderr = tempfile.TemporaryFile()  # not a pipe: a chatty command (curl's meter) never blocks on it
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=self.stderr)

    def __enter__(self) -> IO[bytes]:
        return self.proc.stdout

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> bool:
        self.proc.stdout.close()  # a command still writing ends (SIGPIPE)
        if kind is GeneratorExit:  # the reader took what it wanted
            self.proc.kill()
        try:
            status = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self.stderr.seek(0)
        said = self.stderr.read().decode(errors="replace").strip().splitlines()
        self.stderr.close()
        if status > 0 and (kind is None or issubclass(kind, (tarfile.TarError, EOFError, OSError))):
            raise OSError(f"the command {self.command!r} exited with status {status}"
                          + (f": {said[-1]}" if said else ""))
        return False


class TarStream:
    """One WebDataset tar shard read front to back: raw samples ``(image bytes, label)``.

    Args:
        url: a local path or an fsspec URL.
        key: the recipe key named in errors.
    """

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.count, self.top = self._census()

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, stop: int) -> Iterator[tuple[bytes, int]]:
        if start >= stop:
            return
        for n, image, label in self._samples(lambda n: start <= n < stop):
            if n >= start:
                yield image, label
            if n + 1 >= stop:
                return

    def _samples(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, bytes | None, int]]:
        """(number, image bytes or None when not ``wanted``, label) of each sample, in order.
        The members of a sample are consecutive in the tar (WebDataset's convention)."""
        n, key, image, label = 0, None, None, None
        try:
            with _open(self.url) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    folder, _, name = member.name.rpartition("/")
                    stem, _, ext = name.partition(".")
                    if f"{folder}/{stem}" != key:
                        if image is not None and label is not None:
                            yield n, image or None, label
                            n += 1
                        key, image, label = f"{folder}/{stem}", None, None
                    ext = ext.lower()
                    if ext in IMAGE_EXTENSIONS and image is None:
                        image = tar.extractfile(member).read() if wanted(n) else b""
                    elif ext in _LABEL_EXTENSIONS and label is None:
                        label = parse_label(tar.extractfile(member).read(), member.name, self.url)
                check_complete(tar, self.url, self.key)  # a shard cut between members: an error, not fewer samples
                if image is not None and label is not None:
                    yield n, image or None, label
        except (tarfile.TarError, OSError, EOFError) as e:
            raise TkError(f"{self.key}: cannot read shard {self.url} ({e}); it is damaged, missing or not a tar "
                          f"file") from e

    def _census(self) -> tuple[int, int]:
        """(samples, largest label), from the cache when the shard has not changed."""
        if self.url.startswith(PIPE):  # a command has no size or date: named by itself
            stamp = json.dumps([self.url])
        else:
            try:
                import fsspec

                fs, path = fsspec.core.url_to_fs(self.url)
                info = fs.info(path)
            except ImportError as e:  # fsspec names the missing package
                raise TkError(f"{self.key}: shard {self.url} needs a file system that is not installed ({e}); "
                              f"pip install 'tk[remote]' (https://, s3://, gs://)") from e
            except (OSError, ValueError) as e:
                raise TkError(f"{self.key}: shard {self.url} cannot be opened ({e}); check the path or URL") from e
            stamp = json.dumps([self.url, info.get("size"), str(info.get("mtime") or info.get("ETag") or "")])
        cached = cache_root() / "shards" / f"{hashlib.sha1(stamp.encode()).hexdigest()}.json"
        if cached.is_file():
            record = json.loads(cached.read_text())
            return record["count"], record["top"]
        count, top = 0, -1
        for _, _, label in self._samples(lambda n: False):
            count, top = count + 1, max(top, label)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"count": count, "top": top, "url": self.url}))
        except OSError:  # a read-only cache only costs a census per run
            pass
        return count, top


class HubImageStream:
    """A ``datasets`` image split streamed row by row; raw samples are the undecoded rows.

    Args: as :class:`tk.plugins.image_classification.sources.HubImages`.
    """

    def __init__(self, name: str, config: str | None, split: str, image_column: str, label_column: str,
                 data_files: dict[str, Any] | None = None, class_names: Sequence[str] | None = None) -> None:
        import datasets

        columns = {image_column: "data.image_column", label_column: "data.label_column"}
        folder = Path(name).expanduser()
        if folder.is_dir():  # a save_to_disk folder: its row count, then read as a stream
            ds = load_hub_dataset(name, config, split, data_files=data_files, columns=columns,
                                  split_key="data.hf_split", local="data.source: webdataset")
            self.count, ds = len(ds), ds.to_iterable_dataset()
        else:
            ds = load_hub_dataset(name, config, split, streaming=True, data_files=data_files, columns=columns,
                                  split_key="data.hf_split", local="data.source: webdataset")
            splits = ds.info.splits or {}
            known = splits.get(split)
            if known is None or not known.num_examples:
                raise TkError(f"data.streaming: {name!r} does not say how many rows its {split!r} split has, and "
                              f"every process needs an equal share; set data.streaming=false (download it)")
            self.count = known.num_examples
        feature = ds.features[label_column]
        self.classes = list(class_names) if class_names is not None else list(getattr(feature, "names", []))
        if not self.classes:
            raise TkError(f"data.label_column: {label_column!r} of {name!r} is not a ClassLabel column, so the class "
                          f"names are unknown; list them in data.class_names")
        self.ds = ds.cast_column(image_column, datasets.Image(decode=False))  # decoded in the loader worker
        self.image_column, self.label_column = image_column, label_column

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, stop: int) -> Iterator[tuple[bytes, int]]:
        for row in self.ds.skip(start).take(stop - start):
            image = row[self.image_column]
            data = image["bytes"] if image.get("bytes") is not None else Path(image["path"]).read_bytes()
            yield data, int(row[self.label_column])


class DecodeImage:
    """Raw ``(image bytes, label)`` -> ``{"image": transform(RGB image), "labels": label}``."""

    def __init__(self, transform: Callable | None, num_classes: int, where: str) -> None:
        self.transform, self.num_classes, self.where = transform, num_classes, where

    def __call__(self, raw: tuple[bytes, int]) -> dict[str, Any]:
        data, label = raw
        if not 0 <= label < self.num_classes:
            raise TkError(f"{self.where}: a sample has label {label}, outside the {self.num_classes} classes; "
                          f"check data.class_names")
        try:
            image = Image.open(io.BytesIO(data)).convert("RGB")
        except Exception as e:  # PIL raises several types
            raise TkError(f"{self.where}: a sample's image cannot be decoded ({e}); rewrite the shard") from e
        return {"image": self.transform(image) if self.transform else image, "labels": label}


def expand_urls(pattern: str | Sequence[str]) -> list[str]:
    """The shard URLs of a brace pattern or a list of them (local paths or fsspec URLs)."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    return [os.path.expanduser(u) for pat in patterns for u in braceexpand(pat)]


def build_stream(cfg: Any, split: str, transform: Callable | None, class_names: Sequence[str] | None) -> StreamingDataset:
    """The streamed ``split`` of ``cfg`` (a DataConfig with source hf or webdataset), with ``classes``."""
    if cfg.source == "webdataset":
        if split not in (cfg.shards or {}):
            raise TkError(f"data.shards: no shards for the {split!r} split; add {split}: <shards>")
        key = f"data.shards.{split}"
        sources: list[Any] = [TarStream(url, key) for url in expand_urls(cfg.shards[split])]
        top = max((s.top for s in sources), default=-1)
        classes = list(class_names) if class_names is not None else [str(i) for i in range(top + 1)]
        if top >= len(classes):
            raise TkError(f"data.class_names: the shards hold label {top} but {len(classes)} class names are given; "
                          f"list one name per label 0..{top}")
    else:
        if split not in cfg.hf_split:
            raise TkError(f"data.hf_split: no dataset split for tk's {split!r} split ({cfg.hf_split}); add "
                          f"{split}: <split name>")
        key = f"data.hf_name {cfg.hf_name} ({cfg.hf_split[split]})"
        hub = HubImageStream(cfg.hf_name, cfg.hf_config, cfg.hf_split[split], cfg.image_column, cfg.label_column,
                             cfg.hf_data_files, class_names)
        sources, classes = [hub], hub.classes
    if sum(len(s) for s in sources) == 0:
        raise TkError(f"{key}: no sample with an image ({'/'.join(IMAGE_EXTENSIONS)}) and a label (.cls or .json)")
    dataset = StreamingDataset(sources, DecodeImage(transform, len(classes), key), cfg.shuffle_buffer)
    dataset.classes = classes
    return dataset
