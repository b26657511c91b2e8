"""The ``data:`` and ``tokenizer:`` sections, reading labelled text (CSV/TSV/JSONL files, Hugging
Face ``datasets``, or the synthetic corpus) into rows, and the tokenised dataset."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.core.nn.packing import pack_sequences
from tk.core.text import TextTokenizer, TokenizerConfig, load_hub_dataset, read_records
from tk.plugins.text_classification.synthetic import synthetic_rows

Row = tuple[str, "str | None", Any, str]  # (text, text pair or None, label, "file:line" where it came from)
# multi-label rows hold a tuple of labels (sorted, distinct) in the label slot

SPLITS = ("train", "val", "test")
HF_SPLIT = {"train": "train", "val": "validation", "test": "test"}  # tk split -> dataset split, by default


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
    labels: list[Any] | None = None  # the label set, in class order; a row with another label is an error (null: the train split's labels)
    multi_label: bool = False  # each row has a set of labels (sigmoid + BCE); see label_delimiter
    label_delimiter: str = ","  # multi_label: separator of the labels in the label column (JSONL may give a list)
    hf_name: str | None = None  # hf: datasets.load_dataset name, e.g. "glue" (or "csv" with hf_data_files)
    hf_config: str | None = None  # hf: its config, e.g. "sst2"
    hf_data_files: dict[str, str] | None = None  # hf: split -> local file, for load_dataset("csv"/"json", ...)
    hf_split: dict[str, str] = field(default_factory=lambda: dict(HF_SPLIT))  # hf: tk split -> dataset split
    num_train: int = 4000  # synthetic: training sentences
    num_val: int = 500  # synthetic: validation sentences
    seed: int = 0  # synthetic: seed of the corpus
    max_len: int = 128  # tokens per example incl. [CLS]/[SEP]; longer ones are truncated (counted)
    streaming: bool = False  # files/hf: read each split in order as it comes (a pass counts its rows) instead of holding it in memory; resumes at the batch
    shuffle_buffer: int = 10000  # streaming: rows shuffled together in training
    pack: bool = False  # train and evaluate on rows of max_len tokens holding several examples (attention kept within each): fewer padded tokens, the same results


@dataclass
class TextClsTokenizerConfig(TokenizerConfig):
    """The recipe's ``tokenizer:`` section: trained on the train split's texts (pairs included)
    with BERT's specials and template, unless ``path`` (or ``model.pretrained_from``) gives one."""

    kind: Literal["wordpiece", "bpe", "unigram", "char"] = "wordpiece"  # wordpiece (BERT), byte-level bpe, unigram, char
    vocab_size: int = 8000  # tokens incl. [PAD] [UNK] [CLS] [SEP]
    lowercase: bool = True  # lowercase first (wordpiece also strips accents)
    min_frequency: int = 0  # bpe/wordpiece: occurrences a merge or piece needs (0: the trainers' default)

    def check(self) -> list[str]:
        problems = super().check()
        if self.vocab_size < 16 and not problems:
            problems.append(f"tokenizer.vocab_size ({self.vocab_size}) must be >= 16")
        return problems


def check_data(d: DataConfig) -> list[str]:
    """Problems of the ``data:`` section, one line each naming the key."""
    problems = []
    if d.source == "files" and (d.train_file is None or d.val_file is None):
        problems.append("data.train_file and data.val_file must be set for data.source 'files'")
    if d.source == "hf" and d.hf_name is None:
        problems.append("data.hf_name must be set for data.source 'hf' (e.g. 'glue' with data.hf_config 'sst2')")
    if d.source == "hf" and set(d.hf_split) - set(SPLITS):
        problems.append(f"data.hf_split: keys {sorted(set(d.hf_split) - set(SPLITS))} are not tk splits; "
                        f"map {', '.join(SPLITS)} to dataset splits, e.g. {{train: train, val: validation}}")
    if d.source == "synthetic" and min(d.num_train, d.num_val) < 1:
        problems.append(f"data.num_train ({d.num_train}) and data.num_val ({d.num_val}) must be >= 1")
    if d.max_len < 4:
        problems.append(f"data.max_len ({d.max_len}) must be >= 4")
    if d.multi_label and d.source == "synthetic":
        problems.append("data.multi_label needs data.source 'files' or 'hf' (the synthetic corpus has one label a row)")
    if d.multi_label and not d.label_delimiter:
        problems.append("data.label_delimiter must be a non-empty separator (e.g. ',') with data.multi_label")
    if d.streaming and d.source == "synthetic":
        problems.append("data.streaming is for data.source 'files' or 'hf' (the synthetic corpus is generated in memory)")
    if d.shuffle_buffer < 1:
        problems.append(f"data.shuffle_buffer ({d.shuffle_buffer}) must be >= 1")
    if d.labels is not None and (len(d.labels) < 2 or len(set(map(str, d.labels))) != len(d.labels)):
        problems.append(f"data.labels ({d.labels}) must list at least 2 distinct labels")
    return problems


def _kind(label: Any) -> str:
    text = str(label).strip()
    if text.lstrip("-").isdigit():
        return "integer"
    try:
        float(text)
        return "decimal"
    except ValueError:
        return "text"


def label_set(rows: Iterable[Row], d: DataConfig) -> list[Any]:
    """The classes, in index order: ``data.labels`` (every row's label must be one of them),
    else the train split's labels, sorted, which must all be of one kind (integers, decimals
    or text): a stray "positive" among 0/1 labels would silently become a class of its own.
    One pass over ``rows`` (a streamed split is read once).

    Raises:
        TkError: a label outside ``data.labels``, or a label of another kind than most,
            naming its file:line and the labels seen.
    """
    declared = {str(x): x for x in d.labels} if d.labels is not None else None
    seen: dict[Any, None] = {}  # the labels, in order of appearance
    kinds: dict[str, list] = {}  # kind -> [rows, its first label, where]
    for row in rows:
        for label in (row[2] if d.multi_label else (row[2],)):
            if declared is not None and str(label) not in declared:
                raise TkError(f"{row[3]}: label {label!r} is not one of data.labels {list(d.labels)}; fix the "
                              f"row, or add the label to data.labels")
            seen.setdefault(label)
            kinds.setdefault(_kind(label), [0, label, row[3]])[0] += 1
    if declared is not None:
        found = {str(label): label for label in seen}
        return [found.get(str(x), x) for x in d.labels]  # as the rows spell them ("1" in a TSV, 1 in JSONL)
    if len(kinds) > 1:
        common = max(kinds, key=lambda k: kinds[k][0])
        count, label, where = kinds[min(kinds, key=lambda k: kinds[k][0])]
        odd_kind = _kind(label)
        examples = sorted({str(x) for x in seen if _kind(x) == common})[:4]
        raise TkError(f"{where}: label {label!r} is {odd_kind} while {kinds[common][0]} rows have {common} labels "
                      f"({', '.join(examples)}, ...); fix the row, or declare every class with data.labels=[...]")
    return sorted(seen, key=lambda x: (type(x).__name__, x))


def label_target(label: Any, where: str, labels: Sequence[Any], multi_label: bool,
                 index: dict[tuple[str, Any], int] | None = None) -> Any:
    """A row's label as the class index (a multi-hot list with ``multi_label``) among
    ``labels``; ``index`` (:func:`label_index` of them) saves building it per row.

    Raises:
        TkError: a label not among the train split's, naming the row.
    """
    index = label_index(labels) if index is None else index
    found = []
    for lab in (label if multi_label else (label,)):
        key = (type(lab).__name__, lab)
        if key not in index:
            raise TkError(f"{where}: label {lab!r} is not among the train split's labels {list(labels)[:20]}; "
                          f"fix the row or add the label to the training data")
        found.append(index[key])
    return [1.0 if c in found else 0.0 for c in range(len(labels))] if multi_label else found[0]


def label_index(labels: Sequence[Any]) -> dict[tuple[str, Any], int]:
    """(type name, label) -> class index: the label 1 and the label "1" are not one class."""
    return {(type(lab).__name__, lab): i for i, lab in enumerate(labels)}


def _columns(d: DataConfig) -> dict[str, str]:
    """Column -> the recipe key that names it."""
    cols = {d.text_column: "data.text_column", d.label_column: "data.label_column"}
    return cols | ({d.text_pair_column: "data.text_pair_column"} if d.text_pair_column else {})


def _row(rec: dict, d: DataConfig, where: str) -> Row:
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


def iter_hf_rows(d: DataConfig, split: str) -> Iterator[Row]:
    """The rows of one split of a Hugging Face dataset (hub, or local files through
    ``hf_data_files``), streamed with ``data.streaming``.

    Raises:
        TkError: the dataset, split or a column cannot be loaded, or a row has an empty text/label.
    """
    name = d.hf_split.get(split, HF_SPLIT[split])
    columns = _columns(d)
    ds = load_hub_dataset(d.hf_name, d.hf_config, name, data_files=d.hf_data_files, columns=columns,
                          streaming=d.streaming)
    for i, rec in enumerate(ds):
        where = f"{d.hf_name}[{name}]:{i}"
        for col, key in columns.items():
            if rec[col] is None or (isinstance(rec[col], str) and not rec[col].strip()):
                raise TkError(f"{where}: missing or empty {col!r}; fix the dataset or set {key}")
        yield _row(rec, d, where)


def iter_rows(d: DataConfig, split: str) -> Iterator[Row]:
    """The rows of ``split`` (``train``, ``val``, ``test``) from ``d.source``, in order, read as they come."""
    if d.source == "synthetic":
        n, seed = (d.num_train, d.seed) if split == "train" else (d.num_val, d.seed + 1 + (split == "test"))
        yield from ((text, None, label, f"synthetic[{split}]:{i}") for i, (text, label) in enumerate(synthetic_rows(n, seed)))
        return
    if d.source == "hf":
        yield from iter_hf_rows(d, split)
        return
    key = f"{split}_file"
    if getattr(d, key) is None:
        raise TkError(f"data.{key} is not set; the {split!r} split needs it")
    for r in read_records(getattr(d, key), d.format, key=f"data.{key}", required=_columns(d), allow_empty=False):
        yield _row(r.data, d, r.where)


def read_rows(d: DataConfig, split: str) -> list[Row]:
    """The rows of ``split``, in memory."""
    return list(iter_rows(d, split))


class EncodedDataset(Dataset):
    """Tokenised examples: ``{"input_ids": list, "token_types": list, "labels": int}``."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def check_length(tokenizer: TextTokenizer, texts: Sequence[str], pairs: Sequence[str] | None, max_len: int,
                 truncate: bool) -> None:
    """Refuse, for ``tk predict``, a text the model would see only in part (unless ``truncate``).

    Raises:
        TkError: the longest text's token count and the limit (the engine then retries the
            batch one input at a time, so only the long ones fail).
    """
    longest = max(len(ids) for ids in tokenizer.encode_batch(texts, pairs).ids)
    if longest > max_len and not truncate:
        raise TkError(f"the text has {longest} tokens, more than the {max_len} the model takes (data.max_len); "
                      f"shorten it, or pass predict.truncate=true to classify its first {max_len} tokens")


def collate_examples(samples: list[dict[str, Any]], pad_id: int, multi_label: bool,
                     pack_len: int | None = None) -> dict[str, Any]:
    """A batch of encoded examples: ``input_ids``/``token_types`` padded to the longest (B, T),
    or, with ``pack_len`` and labels, packed into rows of at most ``pack_len`` tokens with
    ``segments`` (:mod:`tk.core.nn.packing`; the model then returns one row of logits per
    example, in order); ``labels``; a distilling run's raw ``texts``/``pairs`` and ``index``."""
    dtype = torch.float32 if multi_label else torch.long  # multi-hot (B, C) or class indices (B,)
    labels = torch.tensor([s["labels"] for s in samples], dtype=dtype) if "labels" in samples[0] else None
    if pack_len is not None and labels is not None:
        packed = pack_sequences([s["input_ids"] for s in samples], pack_len, pad_id,
                                types=[s["token_types"] for s in samples])
        batch = {"input_ids": packed.ids, "token_types": packed.types, "segments": packed.segments}
    else:
        T = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
        types = torch.zeros((len(samples), T), dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
            types[row, : len(s["token_types"])] = torch.tensor(s["token_types"])
        batch = {"input_ids": ids, "token_types": types}
    if "text" in samples[0]:  # distillation: raw texts (the teacher's inputs) and example indices (its cache)
        pairs = [s["pair"] for s in samples]
        batch.update(texts=[s["text"] for s in samples], pairs=None if pairs[0] is None else pairs,
                     index=torch.tensor([s["index"] for s in samples], dtype=torch.long))
    return batch if labels is None else {**batch, "labels": labels}
