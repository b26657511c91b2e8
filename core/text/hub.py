"""Loading a Hugging Face ``datasets`` dataset (a hub name, a builder such as "csv" with local
files, or a folder written by ``save_to_disk``), every failure turned into a one-line ``TkError``
that names the dataset and the fix."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tk.core.errors import TkError

__all__ = ["iter_column", "load_hub_dataset"]

_SAVED = ("dataset_dict.json", "state.json")  # what save_to_disk writes into its folder
_NETWORK = ("couldn't reach", "offline", "connection", "network", "resolve", "max retries", "timed out")


def load_hub_dataset(name: str, config: str | None = None, split: str | None = "train", *, streaming: bool = False,
                     data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
                     columns: Sequence[str] | Mapping[str, str] = (), key: str = "data.hf_name",
                     config_key: str = "data.hf_config", split_key: str = "data.hf_split",
                     local: str = "data.source: files", **kwargs: Any) -> Any:
    """One split of a dataset: ``datasets.load_dataset(name, config, split=..., ...)``, or
    ``datasets.load_from_disk`` when ``name`` is a folder written by ``save_to_disk``.

    ``datasets`` is imported here, not at module import (it is slow to import).

    Args:
        name: a hub id (``"glue"``), a builder (``"csv"``/``"json"`` with ``data_files``), or a folder.
        config: the dataset's config (``"sst2"``); None = its default.
        split: the split (``"train"``, ``"validation"``, ``"train[:10%]"``); None = all of them
            (a ``DatasetDict``).
        streaming: an ``IterableDataset`` read lazily instead of a downloaded ``Dataset``.
        data_files: local files for a builder, e.g. ``{"train": "t.csv"}``.
        columns: columns the dataset must have; a mapping gives, per column, the recipe key
            that names it (``{"text": "data.text_column"}``).
        key, config_key, split_key: the recipe keys named in errors.
        local: the task's offline alternative, named when the hub cannot be reached.
        **kwargs: passed on to ``datasets.load_dataset``.

    Returns:
        A ``Dataset`` (an ``IterableDataset`` when streaming; a ``DatasetDict`` when ``split`` is None).

    Raises:
        TkError: one line naming the dataset (name, config, split) and the fix: no network,
            unknown dataset, config or split, a missing column, anything else ``datasets`` raised.
    """
    import datasets  # lazy: a heavy import only hub sources need

    folder = Path(name).expanduser()
    try:
        if folder.is_dir() and any((folder / f).is_file() for f in _SAVED):
            ds = _from_disk(datasets, folder, name, split, split_key)
            ds = ds.to_iterable_dataset() if streaming and hasattr(ds, "to_iterable_dataset") else ds
        else:
            with _offline_unless_reachable(datasets, probe=data_files is None):
                ds = datasets.load_dataset(name, config, split=split, streaming=streaming, data_files=data_files,
                                           **kwargs)
    except TkError:
        raise
    except Exception as e:  # datasets raises many kinds (offline, missing repo, bad config or split)
        raise TkError(f"{key}: cannot load {name!r} (config {config!r}, split {split!r}): "
                      f"{_explain(e, key, config_key, split_key, local)}") from e
    _check_columns(ds, name, columns, key)
    return ds


def iter_column(ds: Any, column: str, batch_size: int = 1000) -> Iterator[list[str]]:
    """Lists of up to ``batch_size`` non-empty values of ``column``, in order, from a ``Dataset``
    or a streamed ``IterableDataset`` (feed them to ``TextTokenizer.train`` or ``encode_batch``)."""
    for rows in ds.iter(batch_size=batch_size):
        texts = [t for t in rows[column] if t]
        if texts:
            yield texts


def _from_disk(datasets: Any, folder: Path, name: str, split: str | None, split_key: str) -> Any:
    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict) and split is not None:
        if split not in ds:
            raise TkError(f"{split_key}: {name!r} has no split {split!r} (it has {sorted(ds)}); "
                          f"set {split_key} to one of them")
        ds = ds[split]
    return ds


@contextmanager
def _offline_unless_reachable(datasets: Any, probe: bool) -> Iterator[None]:
    """Without a connection to the hub, load in offline mode: a cached dataset loads, another
    fails at once (instead of five retries and ~25 s of warnings)."""
    import huggingface_hub.constants as hub

    if not probe or hub.HF_HUB_OFFLINE or _reachable(hub.ENDPOINT):
        yield
        return
    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's host opens within ``timeout`` seconds."""
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError:
        return False
    return True


def _explain(e: BaseException, key: str, config_key: str, split_key: str, local: str = "data.source: files") -> str:
    """The first line of what ``datasets`` said, and the fix."""
    text = str(e).strip()
    first = (text.splitlines()[0] if text else type(e).__name__)[:300]
    lower = text.lower()
    choices = re.search(r"(\[[^\]]*\])", text.replace("\n", " "))
    one_of = f" to one of {choices.group(1)}" if choices else ""
    if "builderconfig" in lower or "config name is missing" in lower:
        return f"{first}; set {config_key}{one_of}"
    if "unknown split" in lower or "bad split" in lower:
        return f"{first}; set {split_key}{one_of}"
    if isinstance(e, ConnectionError) or any(w in lower for w in _NETWORK):
        return (f"no network and not in the datasets cache ({first}); download it once with network (datasets "
                f"caches it) or use local files ({local})")
    if isinstance(e, FileNotFoundError):
        return (f"{first}; check {key}: a hub dataset id (e.g. 'glue'), a builder ('csv', 'json') with data "
                f"files, or a folder written by save_to_disk")
    return f"{first}; check {key}, {config_key} and {split_key}"


def _check_columns(ds: Any, name: str, columns: Sequence[str] | Mapping[str, str], key: str) -> None:
    names = getattr(ds, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict: every split has the same columns
        names = next(iter(names.values()), None)
    if names is None:  # a stream whose columns are known only once read
        return
    hints = dict(columns) if isinstance(columns, Mapping) else dict.fromkeys(columns, "")
    for col, hint in hints.items():
        if col not in names:
            fix = f"set {hint} to one of them" if hint else "give one of them"
            raise TkError(f"{hint or key}: {name!r} has no column {col!r} (columns: {names}); {fix}")
