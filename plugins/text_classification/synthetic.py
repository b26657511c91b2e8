"""A generated sentiment-like corpus whose label depends on word order and negation.

Each sentence holds one or two adjective phrases ``[not] ADJ`` among filler words; a
phrase's value is the adjective's polarity, flipped by a ``not`` right before it, and the
sentence's label is that value (both phrases of a sentence agree, e.g. "good , not bad").
"good , not bad" and "bad , not good" have the same words: a bag-of-words model cannot
tell them apart (nor "not good" from "good ... not"), while attention to the neighbouring
token can.
"""

from __future__ import annotations

import random

POSITIVE = ("good", "great", "fine", "nice", "fun", "superb", "lovely", "clever")
NEGATIVE = ("bad", "awful", "dull", "poor", "boring", "weak", "ugly", "silly")
NOUNS = ("movie", "film", "plot", "cast", "story", "script", "ending", "score", "show", "acting")
FILLERS = ("the", "a", "this", "was", "is", "really", "quite", "so", "very", "and", "overall", "honestly")
LABELS = ("negative", "positive")


def _phrase(rng: random.Random, value: int) -> list[str]:
    negated = rng.random() < 0.5
    polarity = value ^ negated  # "not" flips the adjective's polarity
    return (["not"] if negated else []) + [rng.choice(POSITIVE if polarity else NEGATIVE)]


def _filler(rng: random.Random, lo: int, hi: int) -> list[str]:
    return [rng.choice(FILLERS) for _ in range(rng.randint(lo, hi))]


def synthetic_rows(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (sentence, label) rows, the label "positive" or "negative", from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        value = rng.randint(0, 1)
        words = _filler(rng, 0, 2) + [rng.choice(NOUNS)] + _filler(rng, 1, 3) + _phrase(rng, value)
        if rng.random() < 0.5:
            words += [","] + _filler(rng, 0, 1) + _phrase(rng, value)
        rows.append((" ".join(words + _filler(rng, 0, 2)), LABELS[value]))
    return rows
