"""A generated named-entity corpus with BIO tags (PER, LOC, ORG), and CoNLL-file reading.

Sentences come from templates with typed slots. Entities have one or two words ("anna",
"anna silva", "new york", "acme corp"), and many words are ambiguous: "jordan" and
"washington" are people in one sentence and places in another, "amazon" a place or a
company, "may", "rose" and "bill" plain words or names; a surname is ``B-PER`` after "mr"
but ``I-PER`` after a first name.
Only the context tells them apart, so tagging every word with its most frequent tag (the
majority-tag baseline) misses those, while an encoder that reads the sentence does not.
All words are lowercase (no capitalisation cue).
"""

from __future__ import annotations

import random
from pathlib import Path

from tk.core import TkError

__all__ = ["TAGS", "generate", "read_conll"]

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]

FIRST = ["anna", "boris", "chen", "dara", "elif", "femi", "gita", "hugo", "ines", "jonas", "kofi", "lena"]
LAST = ["smith", "ng", "okafor", "silva", "berg", "kato", "novak", "rossi", "mensah", "park"]
PLACES = [["paris"], ["lagos"], ["lima"], ["oslo"], ["kyoto"], ["cairo"], ["quito"], ["new", "york"],
          ["san", "jose"], ["buenos", "aires"], ["hong", "kong"]]
COMPANIES = ["acme", "globex", "initech", "umbrella", "vandelay", "hooli", "stark"]
SUFFIXES = ["corp", "group", "bank", "labs"]
# words that are entities of several types, depending on the sentence (some are also plain words)
AMBIGUOUS = {"PER": ["jordan", "georgia", "washington", "ford", "rose", "may", "bill"],
             "LOC": ["jordan", "georgia", "washington", "amazon", "orange", "chad"],
             "ORG": ["orange", "amazon", "ford", "apple", "shell"]}

# templates: words, with {PER} / {LOC} / {ORG} slots
TEMPLATES = [
    "{PER} flew to {LOC} on monday",
    "yesterday {PER} met {PER} in {LOC}",
    "{ORG} hired {PER} last year",
    "according to {PER} , {ORG} will open an office in {LOC}",
    "shares of {ORG} rose after {PER} spoke",
    "the mayor of {LOC} thanked {PER}",
    "{PER} said that {ORG} is moving to {LOC}",
    "we drove from {LOC} to {LOC} with {PER}",
    "{ORG} and {ORG} signed a deal in {LOC}",
    "a new report by {ORG} praised {PER}",
    "it rained in {LOC} while {PER} slept",
    "minister {PER} visited the {ORG} plant",
    "in may {PER} paid the bill for an apple",
    "{PER} may sell a shell to {ORG}",
    "prices rose in {LOC} as {ORG} paid the bill",
]

def _entity(rng: random.Random, typ: str) -> list[str]:
    if rng.random() < 0.4:
        return [rng.choice(AMBIGUOUS[typ])]
    if typ == "PER":
        r = rng.random()
        if r < 0.35:
            return [rng.choice(FIRST)]
        return [rng.choice(FIRST), rng.choice(LAST)] if r < 0.75 else ["mr", rng.choice(LAST)]
    if typ == "LOC":
        return list(rng.choice(PLACES))
    return [rng.choice(COMPANIES)] + ([rng.choice(SUFFIXES)] if rng.random() < 0.5 else [])


def generate(n: int, seed: int) -> list[tuple[list[str], list[str]]]:
    """``n`` (words, BIO tags) sentences from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words, tags = [], []
        for piece in rng.choice(TEMPLATES).split():
            if piece.startswith("{"):
                typ = piece[1:-1]
                entity = _entity(rng, typ)
                if entity[0] == "mr":  # the title is not part of the name
                    words.append("mr")
                    tags.append("O")
                    entity = entity[1:]
                words += entity
                tags += [f"B-{typ}"] + [f"I-{typ}"] * (len(entity) - 1)
            else:
                words.append(piece)
                tags.append("O")
        out.append((words, tags))
    return out


def read_conll(path: str | Path) -> list[tuple[list[str], list[str]]]:
    """Sentences of a CoNLL-style file: one ``word TAG`` per line (the tag last, whitespace
    separated), a blank line between sentences; lines starting with ``-DOCSTART-`` are skipped.

    Raises:
        TkError: a missing file, a line without a tag, or no sentence at all; each names the file (and line).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise TkError(f"data file {path} does not exist; give a CoNLL file (word TAG per line, blank line "
                      f"between sentences) or data.source: synthetic")
    sentences, words, tags = [], [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        parts = line.split()
        if not parts or parts[0] == "-DOCSTART-":
            if words:
                sentences.append((words, tags))
            words, tags = [], []
            continue
        if len(parts) < 2:
            raise TkError(f"{path}:{number}: {line!r} has no tag; each line is `word TAG`")
        words.append(parts[0])
        tags.append(parts[-1])
    if words:
        sentences.append((words, tags))
    if not sentences:
        raise TkError(f"{path}: no sentences found; each line is `word TAG`, sentences separated by a blank line")
    return sentences
