"""Reading text records from CSV / TSV / JSONL / plain-text files, each with its 1-based line
number, and line-aligned parallel text files; every bad row is a one-line ``TkError`` naming
``file:line``."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

from tk.core.errors import TkError

__all__ = ["Format", "Record", "iter_parallel", "read_lines", "read_parallel", "read_records", "record_format", "stream_lines"]

Format = Literal["auto", "csv", "tsv", "jsonl", "text"]
_SUFFIXES = {"csv": "csv", "tsv": "tsv", "jsonl": "jsonl", "json": "jsonl", "txt": "text"}
TEXT_KEY = "text"  # the one key of a plain-text record


class Record(NamedTuple):
    """One record: its fields (CSV/TSV: header -> cell; JSONL: the object; text: ``{"text": line}``),
    the file and the 1-based line it came from (the last line of a multi-line CSV record)."""

    data: dict[str, Any]
    path: Path
    line: int

    @property
    def where(self) -> str:
        """``"file:line"``, for error messages about this record."""
        return f"{self.path}:{self.line}"


def record_format(path: str | Path, format: Format = "auto") -> str:
    """``format``, or the one its suffix names (.csv, .tsv, .jsonl/.json, .txt) when ``"auto"``.

    Raises:
        TkError: ``"auto"`` and an unknown suffix.
    """
    if format != "auto":
        return format
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in _SUFFIXES:
        raise TkError(f"data.format: cannot tell the format of {path} from its suffix; name it .csv, .tsv, .jsonl "
                      f"or .txt, or set data.format to csv, tsv, jsonl or text")
    return _SUFFIXES[suffix]


def read_records(path: str | Path, format: Format = "auto", *, key: str = "data.train_file",
                 required: Sequence[str] | Mapping[str, str] = (), allow_empty: bool = True,
                 fieldnames: Sequence[str] | None = None) -> Iterator[Record]:
    """The records of a file, streamed, in order.

    CSV (quoted, RFC 4180) and TSV (unquoted: a ``"`` is text, as in GLUE) take their column
    names from the first line unless ``fieldnames`` is given; every row must have as many fields.
    JSONL: one JSON object per line, blank lines skipped. Text: one record per line, blank lines
    kept (they keep parallel files aligned). A UTF-8 byte-order mark is ignored.

    Args:
        path: the file.
        format: ``"auto"`` (from the suffix), ``"csv"``, ``"tsv"``, ``"jsonl"`` or ``"text"``.
        key: the recipe key that set ``path``, named when the file is missing or empty.
        required: columns/keys each record must have; a mapping gives, per column, the recipe
            key that names it (``{"sentence": "data.text_column"}``), for the fix in the message.
        allow_empty: False = an empty or blank value of a required column is an error too.
        fieldnames: CSV/TSV without a header line: the column names.

    Raises:
        TkError: the file is missing or has no records; a row is bad (wrong number of fields,
            invalid JSON, not an object, a required column missing, undecodable UTF-8), named
            ``file:line`` with the fix.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise TkError(f"{key}: {path} does not exist; set {key} to an existing .csv, .tsv, .jsonl or text file")
    fmt = record_format(path, format)
    hints = dict(required) if isinstance(required, Mapping) else dict.fromkeys(required, "")
    lines = _decoded_lines(path)
    if fmt == "jsonl":
        records = _jsonl(path, lines)
    elif fmt == "text":
        records = (Record({TEXT_KEY: text.rstrip("\r\n")}, path, n) for n, text in lines)
    else:
        records = _delimited(path, lines, fmt, fieldnames)
    count = 0
    for record in records:
        _check(record, hints, allow_empty)
        count += 1
        yield record
    if count == 0:
        blank = not path.read_bytes().strip()
        what = "is empty" if blank else "has a header but no rows" if fmt in ("csv", "tsv") and not fieldnames \
            else "has no records"
        raise TkError(f"{key}: {path} {what}; give a file with at least one record")


def read_lines(path: str | Path, key: str = "data.train_file") -> list[str]:
    """The lines of a text file, without their line endings (blank lines kept).

    Raises:
        TkError: see :func:`read_records`.
    """
    return [r.data[TEXT_KEY] for r in read_records(path, "text", key=key)]


def read_parallel(src_path: str | Path, tgt_path: str | Path, key: str = "data.train_prefix") -> list[tuple[str, str]]:
    """Line-aligned parallel files (``train.en`` / ``train.de``): line i of one translates line i
    of the other.

    Raises:
        TkError: a file is missing or empty, or the two have different line counts (both named).
    """
    src, tgt = read_lines(src_path, key), read_lines(tgt_path, key)
    if len(src) != len(tgt):
        raise _misaligned(src_path, len(src), tgt_path, len(tgt))
    return list(zip(src, tgt))


def iter_parallel(src_path: str | Path, tgt_path: str | Path, key: str = "data.train_prefix") -> Iterator[tuple[str, str]]:
    """:func:`read_parallel` read lazily: the line pairs in order; files of different lengths
    are the same error, raised when the shorter one ends."""
    src, tgt = read_records(src_path, "text", key=key), read_records(tgt_path, "text", key=key)
    n = 0
    for a in src:
        b = next(tgt, None)
        if b is None:
            raise _misaligned(src_path, f"more than {n}", tgt_path, n)
        n += 1
        yield a.data[TEXT_KEY], b.data[TEXT_KEY]
    rest = sum(1 for _ in tgt)
    if rest:
        raise _misaligned(src_path, n, tgt_path, n + rest)


def _misaligned(src_path: str | Path, src_lines: int | str, tgt_path: str | Path, tgt_lines: int) -> TkError:
    return TkError(f"misaligned parallel files: {src_path} has {src_lines} lines but {tgt_path} has {tgt_lines}; "
                   f"each line of one must translate the same line of the other")


def stream_lines(stream: IO, name: str | None = None) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` per line of an open stream (standard input, a click file),
    line endings removed, read lazily: bytes are decoded as UTF-8, and a line that is not
    UTF-8 (or arrived as undecodable characters in a text stream) is one error naming the
    stream and the line.

    Raises:
        TkError: a line that is not UTF-8 text.
    """
    source = iter(getattr(stream, "buffer", stream))  # the bytes under a text stream, when it has them
    named = getattr(stream, "name", None)
    name = name or (named if isinstance(named, str) and named not in ("<stdin>", "-") else "standard input")
    n = 0
    while True:
        try:
            raw = next(source)
        except StopIteration:
            return
        except UnicodeDecodeError as e:  # a text stream could not decode its next line
            raise _not_utf8(name, n + 1, e.reason) from None
        n += 1
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            text.encode("utf-8")  # surrogates from a lenient text stream fail here
        except UnicodeError as e:
            raise _not_utf8(name, n, e.reason) from None
        yield n, (text.removeprefix("\ufeff") if n == 1 else text).rstrip("\r\n")


def _not_utf8(name: str, line: int, reason: str) -> TkError:
    return TkError(f"{name} line {line}: not valid UTF-8 ({reason}); give UTF-8 text (re-encode it, e.g. "
                   f"iconv -f latin1 -t utf-8)")


# helpers --------------------------------------------------------------------------------------
def _decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` per line, line endings kept; bad UTF-8 named with its line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TkError(f"{path}:{n}: not valid UTF-8 ({e.reason} at byte {e.start} of the line); "
                              f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            yield n, text.removeprefix("\ufeff") if n == 1 else text


def _jsonl(path: Path, lines: Iterable[tuple[int, str]]) -> Iterator[Record]:
    for n, text in lines:
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TkError(f"{path}:{n}: not valid JSON ({e.msg}, character {e.pos + 1}); "
                          f"JSONL needs one JSON object per line") from None
        if not isinstance(obj, dict):
            raise TkError(f"{path}:{n}: expected a JSON object ({{\"key\": value, ...}}), got {type(obj).__name__}")
        yield Record(obj, path, n)


def _delimited(path: Path, lines: Iterable[tuple[int, str]], fmt: str, fieldnames: Sequence[str] | None
               ) -> Iterator[Record]:
    texts = (text for _, text in lines)  # every line once, so reader.line_num is the file's line
    # GLUE's TSVs are unquoted (a '"' is part of the text)
    reader = csv.reader(texts, delimiter="\t", quoting=csv.QUOTE_NONE) if fmt == "tsv" else csv.reader(texts)
    header = list(fieldnames) if fieldnames is not None else None
    sep = "tab" if fmt == "tsv" else "comma"
    try:
        for row in reader:
            if not row:  # a blank line
                continue
            if header is None:
                header = row
                continue
            if len(row) != len(header):
                quote = " (quote a field that has a comma)" if fmt == "csv" else ""
                raise TkError(f"{path}:{reader.line_num}: {len(row)} {sep}-separated fields, expected {len(header)} "
                              f"({', '.join(header)}); fix the row{quote}")
            yield Record(dict(zip(header, row)), path, reader.line_num)
    except csv.Error as e:
        raise TkError(f"{path}:{reader.line_num}: not valid {fmt.upper()} ({e}); fix the row") from None


def _check(record: Record, hints: Mapping[str, str], allow_empty: bool) -> None:
    for col, hint in hints.items():
        value = record.data.get(col)
        empty = not allow_empty and (value is None or (isinstance(value, str) and not value.strip()))
        if col not in record.data or empty:
            have = ", ".join(map(str, record.data)) or "none"
            fix = f"fix the row or set {hint}" if hint else "fix the row"
            raise TkError(f"{record.where}: missing {'or empty ' if not allow_empty else ''}{col!r} "
                          f"(columns: {have}); {fix}")
