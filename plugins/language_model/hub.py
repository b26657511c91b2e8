"""Reading a Hugging Face ``datasets`` corpus: a hub name or a folder saved with ``save_to_disk``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tk.core.errors import TkError


def load_documents(dataset: str, config: str | None, split: str, text_column: str) -> Any:
    """The ``split`` of ``dataset`` (a hub name for ``datasets.load_dataset``, or a local folder
    written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``), checked to have
    ``text_column``.

    Raises:
        TkError: the dataset, split or column does not exist.
    """
    import datasets  # lazy: only hub corpora need it (a heavy import)

    try:
        if Path(dataset).expanduser().is_dir():
            ds = datasets.load_from_disk(str(Path(dataset).expanduser()))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise TkError(f"data.split: {dataset!r} has no split {split!r} (it has {sorted(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(dataset, config, split=split)
    except TkError:
        raise
    except Exception as e:  # datasets raises many kinds (missing repo, no connection, bad config)
        raise TkError(f"data.dataset: cannot load {dataset!r} (config {config!r}, split {split!r}): {e}") from e
    if text_column not in ds.column_names:
        raise TkError(f"data.text_column: {dataset!r} has no column {text_column!r} (columns: {ds.column_names})")
    return ds


def iter_texts(ds: Any, text_column: str, batch: int = 1000) -> Iterator[list[str]]:
    """Lists of up to ``batch`` non-empty documents of the column, in order."""
    for start in range(0, len(ds), batch):
        texts = [t for t in ds[start: start + batch][text_column] if t]
        if texts:
            yield texts
