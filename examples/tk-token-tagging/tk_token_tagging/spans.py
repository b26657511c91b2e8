"""Entities of BIO tag sequences and entity-level precision / recall / F1 (exact span match).

The rules are conlleval's (CoNLL-2000/2003): ``B-X`` starts an entity of type X; ``I-X``
continues an open entity of type X and otherwise starts one (an ``I-X`` after ``O`` or
after another type); ``O`` closes the open entity. A predicted entity counts as correct
only when its type, start and end all equal a gold entity's.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["bio_spans", "prf", "span_counts"]

Span = tuple[str, int, int]  # (type, start, end): words start..end-1


def bio_spans(tags: Sequence[str]) -> list[Span]:
    """The entities of one BIO sequence, in order.

    Args:
        tags: e.g. ``["B-PER", "I-PER", "O", "B-LOC"]``.

    Returns:
        ``[(type, start, end), ...]`` with ``end`` exclusive, e.g. ``[("PER", 0, 2), ("LOC", 3, 4)]``.

    Raises:
        ValueError: a tag that is neither ``O`` nor ``B-X`` / ``I-X``.
    """
    spans: list[Span] = []
    open_type, start = None, 0
    for i, tag in enumerate(tags):
        if tag == "O":
            if open_type is not None:
                spans.append((open_type, start, i))
            open_type = None
            continue
        if tag[:2] not in ("B-", "I-") or len(tag) < 3:
            raise ValueError(f"tag {tag!r} at position {i} is not BIO (O, B-TYPE or I-TYPE)")
        kind, typ = tag[0], tag[2:]
        if kind == "B" or typ != open_type:
            if open_type is not None:
                spans.append((open_type, start, i))
            open_type, start = typ, i
    if open_type is not None:
        spans.append((open_type, start, len(tags)))
    return spans


def span_counts(gold: Sequence[str], pred: Sequence[str]) -> tuple[int, int, int]:
    """``(correct, predicted, gold)`` entity counts of one sentence (exact type + boundaries).

    Raises:
        ValueError: sequences of different lengths, or a non-BIO tag.
    """
    if len(gold) != len(pred):
        raise ValueError(f"gold and predicted tags differ in length ({len(gold)} vs {len(pred)})")
    g, p = set(bio_spans(gold)), set(bio_spans(pred))
    return len(g & p), len(p), len(g)


def prf(correct: int, predicted: int, gold: int) -> tuple[float, float, float]:
    """Precision, recall and F1 from entity counts (0 where a denominator is 0)."""
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1
