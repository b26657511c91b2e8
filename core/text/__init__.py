"""tk.core.text: the text layer shared by text tasks.

- ``tokenizer``: :class:`TextTokenizer` over Hugging Face ``tokenizers`` (char, byte-level BPE,
  WordPiece, Unigram), its recipe section :class:`TokenizerConfig` and :func:`build_tokenizer`.
- ``reader``: :func:`read_records` (CSV / TSV / JSONL / text, with ``file:line`` errors),
  :func:`read_lines`, :func:`read_parallel` (:func:`iter_parallel`: the same, lazily).
- ``token_store``: :class:`TokenStore`, a corpus's token file in ``$TK_CACHE/tokens``, built in
  chunks that a killed build continues, reused by later runs.
- ``hub``: :func:`load_hub_dataset` (``datasets``, with one-line errors), :func:`iter_column`.
- ``chat``: :class:`ChatTemplate` (a model's jinja chat template, rendered as transformers does),
  :func:`encode_chat` (ids and the assistant-token mask), :func:`read_chat_template`.
- ``metrics``: :class:`Perplexity`, :class:`ClassificationMetrics`, :class:`MultiLabelMetrics`;
  ``confusion``: :func:`save_confusion_png`.

Exports load lazily (PEP 562), as in ``tk.core``: importing one module (e.g. the confusion
plot for image classification) does not import ``tokenizers`` or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "TokenizerConfig": "tokenizer", "TextTokenizer": "tokenizer", "Encoded": "tokenizer", "Template": "tokenizer",
    "BERT_SPECIALS": "tokenizer", "BERT_TEMPLATE": "tokenizer", "build_tokenizer": "tokenizer",
    "encode_long": "long_text", "cut_pieces": "long_text", "TokenStore": "token_store",
    "Record": "reader", "read_records": "reader", "read_lines": "reader", "read_parallel": "reader",
    "record_format": "reader", "stream_lines": "reader", "iter_parallel": "reader",
    "load_hub_dataset": "hub", "iter_column": "hub",
    "Perplexity": "metrics", "ClassificationMetrics": "metrics", "MultiLabelMetrics": "metrics",
    "save_confusion_png": "confusion",
    "ChatTemplate": "chat", "encode_chat": "chat", "read_chat_template": "chat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # cache: the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
