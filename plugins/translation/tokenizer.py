"""Subword tokenizers (Hugging Face ``tokenizers``): trained once on the train split in
``setup``, saved as task files, reloaded everywhere else (never retrained)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tk.core.errors import TkError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]  # trained tokenizers give them ids 0, 1, 2, 3


@dataclass
class TokenizerConfig:
    """The recipe's ``tokenizer:`` section."""

    kind: Literal["bpe", "unigram"] = "bpe"  # subword model trained on the train split
    vocab_size: int = 8000  # subword vocabulary size (specials included); a cap for small corpora
    joint: bool = True  # one vocabulary for both languages (needed by model.share_embeddings)
    path: str | None = None  # an existing tokenizer.json to use instead of training (joint only)
    min_frequency: int = 2  # bpe: a merge needs at least this many occurrences


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """A Metaspace-pre-tokenised BPE or Unigram tokenizer; ``decode`` restores the spacing."""
    if cfg.kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                      special_tokens=SPECIALS, show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIALS, unk_token=UNK,
                                          show_progress=False)
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A saved ``tokenizer.json`` that has the four special tokens.

    Raises:
        TkError: the file is missing or lacks one of ``<pad> <s> </s> <unk>``.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise TkError(f"tokenizer file not found: {path}; set tokenizer.path to a tokenizer.json or leave it null")
    tok = Tokenizer.from_file(str(path))
    missing = [s for s in SPECIALS if tok.token_to_id(s) is None]
    if missing:
        raise TkError(f"tokenizer {path} lacks the special tokens {missing}; it needs {SPECIALS}")
    return tok


class Vocab:
    """A tokenizer plus its special ids, with batch encode/decode of plain strings."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.pad, self.bos, self.eos, self.unk = (tok.token_to_id(s) for s in SPECIALS)
        self.size = tok.get_vocab_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Subword ids of each text (no specials added)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenised text of each id list; specials (PAD, EOS, ...) are left out."""
        return self.tok.decode_batch(ids, skip_special_tokens=True)
