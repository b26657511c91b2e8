"""Tokenisers: character level (with UNK) or a ``tokenizers`` byte-level BPE, saved as one JSON text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tk.core.errors import TkError

HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "gpt2", "openai-community/gpt2"
UNK = "<unk>"  # char level: id 0; any character not seen in the training split maps to it


class CharTokenizer:
    """One id per character of the training split; id 0 is UNK (unknown characters)."""

    kind = "char"

    def __init__(self, chars: list[str]) -> None:
        self.chars = list(chars)
        self.index = {c: i + 1 for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        return cls.train_from_texts([text])

    @classmethod
    def train_from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The characters of a stream of texts (only their set is held in memory)."""
        chars: set[str] = set()
        for t in texts:
            chars.update(t)
        return cls(sorted(chars))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, 0) for c in text]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i - 1] if 0 < i <= len(self.chars) else UNK for i in ids)

    def to_json(self) -> str:
        return json.dumps({"kind": "char", "unk": UNK, "chars": self.chars})


class BPETokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (byte-level BPE when trained here)."""

    kind = "bpe"

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        return cls.train_from_texts([text], vocab_size)

    @classmethod
    def train_from_texts(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Byte-level BPE trained on a stream of texts, fed to the trainer in batches of lines
        (the trainer keeps word counts, not the text)."""
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(_line_batches(texts), trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def to_json(self) -> str:
        return self.tok.to_str()


def _line_batches(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        for line in text.splitlines(keepends=True):
            batch.append(line)
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch


def load_tokenizer_json(text: str) -> CharTokenizer | BPETokenizer:
    """The tokenizer saved by ``to_json`` (either kind)."""
    data = json.loads(text)
    if data.get("kind") == "char":
        return CharTokenizer(data["chars"])
    return BPETokenizer(Tokenizer.from_str(text))


def read_tokenizer_file(path: str) -> BPETokenizer:
    """A given ``tokenizer.json`` (``data.tokenizer_file``), or a hub model name whose
    ``tokenizer.json`` ``tokenizers`` downloads (e.g. ``gpt2``) when no such file exists."""
    p = Path(path).expanduser()
    if not p.exists() and not path.endswith(".json") and HUB_ID.fullmatch(path):
        try:
            return BPETokenizer(Tokenizer.from_pretrained(path))
        except Exception as e:  # no network, or no such repository
            raise TkError(f"data.tokenizer_file: {path!r} is neither a file nor a hub model with a tokenizer.json "
                          f"({e}); give a local tokenizer.json") from e
    if not p.is_file():
        raise TkError(f"data.tokenizer_file: no file at {path!r}; give a tokenizers tokenizer.json or set it to null")
    try:
        return BPETokenizer(Tokenizer.from_file(str(p)))
    except Exception as e:  # tokenizers raises a plain Exception on bad JSON
        raise TkError(f"data.tokenizer_file: {path!r} is not a tokenizers tokenizer.json ({e})") from e
