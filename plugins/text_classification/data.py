"""The ``data:`` section, reading labelled text (CSV/TSV/JSONL files, Hugging Face
``datasets``, or the synthetic corpus) into rows, and the tokenised dataset."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.plugins.text_classification.synthetic import synthetic_rows

Row = tuple[str, "str | None", Any, str]  # (text, text pair or None, label, "file:line" where it came from)
# multi-label rows hold a tuple of labels (sorted, distinct) in the label slot


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "files", "hf"] = "synthetic"  # where the rows come from
    train_file: str | None = None  # files: training rows (.csv, .tsv or .jsonl)
    val_file: str | None = None  # files: validation rows (same layout)
    test_file: str | None = None  # files: optional test rows
    format: Literal["auto", "csv", "tsv", "jsonl"] = "auto"  # files: auto = from the file suffix
    text_column: str = "sentence"  # column/key of the text (GLUE SST-2: sentence)
    text_pair_column: str | None = None  # column of the second text of a pair (e.g. MRPC sentence2); null = single
    label_column: str = "label"  # column/key of the label (strings or integers)
    multi_label: bool = False  # each row has a set of labels (sigmoid + BCE); see label_delimiter
    label_delimiter: str = ","  # multi_label: separator of the labels in the label column (JSONL may give a list)
    hf_name: str | None = None  # hf: datasets.load_dataset name, e.g. "glue" (or "csv" with hf_data_files)
    hf_config: str | None = None  # hf: its config, e.g. "sst2"
    hf_data_files: dict[str, str] | None = None  # hf: split -> local file, for load_dataset("csv"/"json", ...)
    hf_splits: dict[str, str] | None = None  # hf: tk split -> dataset split; default train, validation, test
    num_train: int = 4000  # synthetic: training sentences
    num_val: int = 500  # synthetic: validation sentences
    seed: int = 0  # synthetic: seed of the corpus
    tokenizer: Literal["wordpiece", "bpe"] = "wordpiece"  # tokenizer trained on the train split
    vocab_size: int = 8000  # trained tokenizer: vocabulary size (incl. special tokens)
    lowercase: bool = True  # trained tokenizer: lowercase and strip accents first
    max_len: int = 128  # tokens per example incl. [CLS]/[SEP]; longer ones are truncated (counted)


def check_data(d: DataConfig) -> list[str]:
    """Problems of the ``data:`` section, one line each naming the key."""
    problems = []
    if d.source == "files" and (d.train_file is None or d.val_file is None):
        problems.append("data.train_file and data.val_file must be set for data.source 'files'")
    if d.source == "hf" and d.hf_name is None:
        problems.append("data.hf_name must be set for data.source 'hf' (e.g. 'glue' with data.hf_config 'sst2')")
    if d.source == "synthetic" and min(d.num_train, d.num_val) < 1:
        problems.append(f"data.num_train ({d.num_train}) and data.num_val ({d.num_val}) must be >= 1")
    if d.max_len < 4:
        problems.append(f"data.max_len ({d.max_len}) must be >= 4")
    if d.multi_label and d.source == "synthetic":
        problems.append("data.multi_label needs data.source 'files' or 'hf' (the synthetic corpus has one label a row)")
    if d.multi_label and not d.label_delimiter:
        problems.append("data.label_delimiter must be a non-empty separator (e.g. ',') with data.multi_label")
    if d.vocab_size < 16:
        problems.append(f"data.vocab_size ({d.vocab_size}) must be >= 16")
    return problems


def _format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower().lstrip(".")
    if suffix in ("csv", "tsv", "jsonl"):
        return suffix
    if suffix == "json":
        return "jsonl"
    raise TkError(f"data.format: cannot tell the format of {path} from its suffix; set data.format to csv, tsv or jsonl")


def _records(path: Path, fmt: str):
    """(line number, dict) per record of a file."""
    with open(path, encoding="utf-8", newline="") as f:
        if fmt == "jsonl":
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except ValueError as e:
                        raise TkError(f"{path}:{n}: not a JSON object: {e}") from e
            return
        # GLUE's TSVs are unquoted (a '"' is part of the text)
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if fmt == "tsv" else csv.DictReader(f)
        for record in reader:
            yield reader.line_num, record


def read_file_rows(path_str: str, d: DataConfig, key: str) -> list[Row]:
    """The rows of one file.

    Raises:
        TkError: a missing file, a missing column, or a row with an empty text/label (named
            with its file and line).
    """
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise TkError(f"data.{key}: {path} does not exist; set data.{key} to a .csv, .tsv or .jsonl file")
    rows = []
    for line, rec in _records(path, _format(path, d.format)):
        if not isinstance(rec, dict):
            raise TkError(f"{path}:{line}: expected an object with keys {d.text_column!r}, {d.label_column!r}")
        rows.append(_row(rec, d, f"{path}:{line}"))
    if not rows:
        raise TkError(f"data.{key}: {path} has no rows")
    return rows


def _row(rec: dict, d: DataConfig, where: str) -> Row:
    columns = [d.text_column, d.label_column] + ([d.text_pair_column] if d.text_pair_column else [])
    for col in columns:
        value = rec.get(col)
        if value is None or (isinstance(value, str) and not value.strip()):
            have = ", ".join(map(str, rec)) or "none"
            raise TkError(f"{where}: missing or empty {col!r} (columns: {have}); fix the row or set "
                          f"data.text_column / data.label_column")
    label = rec[d.label_column]
    label = label.strip() if isinstance(label, str) else label
    if d.multi_label:
        label = _label_set(label, d, where)
    pair = str(rec[d.text_pair_column]) if d.text_pair_column else None
    return str(rec[d.text_column]), pair, label, where


def _label_set(value: Any, d: DataConfig, where: str) -> tuple:
    """A multi-label cell: ``"a,b"`` split on ``data.label_delimiter``, or a JSON list."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(d.label_delimiter)
    labels = tuple(sorted({x.strip() if isinstance(x, str) else x for x in items} - {""}, key=str))
    if not labels:
        raise TkError(f"{where}: no labels in {d.label_column!r} ({value!r}); give at least one, separated by "
                      f"data.label_delimiter ({d.label_delimiter!r})")
    return labels


def read_hf_rows(d: DataConfig, split: str) -> list[Row]:
    """The rows of one split of a Hugging Face dataset (hub, or local files through
    ``hf_data_files``)."""
    import datasets  # lazy: only data.source 'hf' needs it (slow import)

    names = {"train": "train", "val": "validation", "test": "test", **(d.hf_splits or {})}
    try:
        ds = datasets.load_dataset(d.hf_name, d.hf_config, data_files=d.hf_data_files, split=names[split])
    except Exception as e:  # datasets raises many kinds (missing, offline, bad config)
        raise TkError(f"data.hf_name: cannot load {d.hf_name!r} (config {d.hf_config!r}, split {names[split]!r}): "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return [_row(rec, d, f"{d.hf_name}[{names[split]}]:{i}") for i, rec in enumerate(ds)]


def read_rows(d: DataConfig, split: str) -> list[Row]:
    """The rows of ``split`` (``train``, ``val``, ``test``) from ``d.source``."""
    if d.source == "synthetic":
        n, seed = (d.num_train, d.seed) if split == "train" else (d.num_val, d.seed + 1 + (split == "test"))
        return [(text, None, label, f"synthetic[{split}]:{i}") for i, (text, label) in enumerate(synthetic_rows(n, seed))]
    if d.source == "hf":
        return read_hf_rows(d, split)
    key = {"train": "train_file", "val": "val_file", "test": "test_file"}[split]
    path = getattr(d, key)
    if path is None:
        raise TkError(f"data.{key} is not set; the {split!r} split needs it")
    return read_file_rows(path, d, key)


class EncodedDataset(Dataset):
    """Tokenised examples: ``{"input_ids": list, "token_types": list, "labels": int}``."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]
