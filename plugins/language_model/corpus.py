"""Reading the text corpus: a file, a folder, a glob, or the built-in synthetic grammar."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

from tk.core.errors import TkError

SUBJECTS = {"sg": ["the cat", "a dog", "the old man", "my sister", "the bird"],
            "pl": ["the cats", "two dogs", "the children", "my friends", "birds"]}
VERBS = {"sg": ["sees", "likes", "chases", "finds"], "pl": ["see", "like", "chase", "find"]}
OBJECTS = ["the ball", "a red apple", "the garden", "some bread", "the river", "a small house"]
ADVERBS = ["today", "again", "slowly", "at night"]


def _sentence(rng: np.random.Generator) -> str:
    """One sentence of the grammar: number agreement between subject and verb, an optional
    adverb and an optional coordinated clause, so a model can learn more than unigrams."""
    number = "sg" if rng.random() < 0.5 else "pl"
    words = [SUBJECTS[number][rng.integers(5)], VERBS[number][rng.integers(4)], OBJECTS[rng.integers(6)]]
    if rng.random() < 0.3:
        words.append(ADVERBS[rng.integers(4)])
    text = " ".join(words)
    if rng.random() < 0.25:
        text += " and " + _sentence(rng)[:-2]
    return text + ".\n"


def synthetic_text(num_sentences: int, seed: int) -> str:
    """``num_sentences`` sentences of the built-in probabilistic grammar (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    return "".join(_sentence(rng) for _ in range(num_sentences))


def read_corpus(path: str) -> str:
    """The UTF-8 text of ``data.path``: a file, every file under a folder, or a glob (files joined
    in sorted order).

    Raises:
        TkError: nothing matches, or a file is not UTF-8.
    """
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise TkError(f"data.path: no text file at {path!r} (give a file, a folder of text files or a glob, "
                      f"or set data.source=synthetic)")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise TkError(f"data.path: {f} is not UTF-8 text ({e}); convert it or leave it out of data.path") from e
    return "".join(parts)
