"""``data.streaming`` for text classification: a split's rows read in order from its file or
a streamed hub split (:class:`tk.core.data.stream.StreamingDataset`: an equal share per
process, resumed at the batch), tokenised in the loader worker."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from tk.core.data.stream import IterSource, StreamingDataset
from tk.core.errors import TkError
from tk.core.text import TextTokenizer
from tk.plugins.text_classification.data import DataConfig, Row, iter_rows, label_index, label_target

__all__ = ["EncodeRow", "row_stream"]


class EncodeRow:
    """A row -> ``{"input_ids", "token_types", "labels"}``, cut to ``max_len`` tokens."""

    def __init__(self, tokenizer: TextTokenizer, labels: Sequence[Any], multi_label: bool, max_len: int) -> None:
        self.tokenizer, self.labels, self.multi_label, self.max_len = tokenizer, list(labels), multi_label, max_len
        self.index = label_index(self.labels)

    def __call__(self, row: Row) -> dict[str, Any]:
        text, pair, label, where = row
        enc = self.tokenizer.encode_batch([text], None if pair is None else [pair], max_length=self.max_len)
        return {"input_ids": enc.ids[0], "token_types": enc.type_ids[0],
                "labels": label_target(label, where, self.labels, self.multi_label, self.index)}


def row_stream(d: DataConfig, split: str, tokenizer: TextTokenizer, labels: Sequence[Any], max_len: int,
               distilling: bool) -> StreamingDataset:
    """The streamed ``split`` (one pass counts its rows first).

    Raises:
        TkError: with distillation (its teacher cache is indexed by example), or an empty split.
    """
    if distilling:
        raise TkError("data.streaming: distillation caches the teacher's logits by example index, which a stream "
                      "has not; set data.streaming=false")
    source = IterSource(partial(iter_rows, d, split))
    if not len(source):
        raise TkError(f"the {split!r} split has no rows; check data.{split}_file or data.hf_split")
    return StreamingDataset([source], EncodeRow(tokenizer, labels, d.multi_label, max_len), d.shuffle_buffer)
