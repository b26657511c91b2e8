"""Reading the text corpus: a file, a folder, a glob, or the built-in synthetic grammar."""

from __future__ import annotations

import glob
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from tk.core.errors import TkError

SUBJECTS = {"sg": ["the cat", "a dog", "the old man", "my sister", "the bird"],
            "pl": ["the cats", "two dogs", "the children", "my friends", "birds"]}
VERBS = {"sg": ["sees", "likes", "chases", "finds"], "pl": ["see", "like", "chase", "find"]}
OBJECTS = ["the ball", "a red apple", "the garden", "some bread", "the river", "a small house"]
ADVERBS = ["today", "again", "slowly", "at night"]
_CHUNK = 1 << 22  # characters read at a time from a corpus file (~4-16 MB)


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


def corpus_files(path: str) -> list[Path]:
    """The files of ``data.path``: a file, every file under a folder, or a glob (sorted).

    Raises:
        TkError: nothing matches.
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
    return files


def iter_corpus(files: Sequence[Path], chunk: int | None = None) -> Iterator[str]:
    """The text of ``files`` joined, in chunks of ``chunk`` characters at most: a corpus larger
    than memory is never held. Newlines are universal (``\\r\\n`` reads as ``\\n``), as ``read_text``.

    Raises:
        TkError: a file is not UTF-8 (naming it).
    """
    chunk = chunk or _CHUNK
    for f in files:
        try:
            with open(f, encoding="utf-8") as text:
                while part := text.read(chunk):
                    yield part
        except UnicodeDecodeError as e:
            raise TkError(f"data.path: {f} is not UTF-8 text ({e}); convert it or leave it out of data.path") from e


def take_chars(chunks: Iterable[str], n: int) -> Iterator[str]:
    """The first ``n`` characters of ``chunks``."""
    for part in chunks:
        if n <= 0:
            return
        yield part[:n]
        n -= len(part)
