"""Subword training that gives the same vocabulary in every process.

``tokenizers`` (0.23) trains WordPiece and Unigram differently from one process to the next for
the same texts: its trainers walk Rust ``HashMap``s, whose order is seeded per process, and
that order decides ties (huggingface/tokenizers#1794). Byte-level BPE does not depend on it:
its alphabet is sorted and its merges are ordered by (count, pair ids).

- WordPiece is BPE with a ``##`` mark on pieces inside a word, and ``WordPieceTrainer`` runs the
  BPE trainer, which gives each ``##c`` its id in map order. Here each character inside a word
  is first written as a private-use character that sorts like it, so every piece of the
  alphabet is a plain character with a sorted id and the BPE trainer's result is fixed; the
  vocabulary is then written back with ``##``.
- Unigram's vocabulary is the same set, but its scores differ in the last bits (sums taken in
  map order) and the characters it appends with tied counts come in map order. Here the
  scores are rounded and the tied characters get their scores in character order.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tk.core.errors import TkError

__all__ = ["canonical_unigram", "train_wordpiece"]

_PRIVATE = [(0xF0000, 0xFFFFD), (0x100000, 0x10FFFD), (0xE000, 0xF8FF)]  # supplementary planes first
_SCORE_DIGITS = 6  # Unigram scores: log-probabilities near -10, noise from sum order below 1e-10
_APPENDED_STEP = 1e-4  # the score step between characters the Unigram trainer appends
_FEED = 1 << 16  # characters per string fed to the trainer


def train_wordpiece(tok: Tokenizer, lines: Iterable[str], vocab_size: int, min_frequency: int,
                    specials: list[str], unk: str) -> Tokenizer:
    """Train ``tok``'s WordPiece model (its normaliser and pre-tokenizer already set) on ``lines``,
    the same way in every process; returns ``tok`` with the trained model and the specials added.

    Same vocabulary rules as ``trainers.WordPieceTrainer``: specials, every character, ``##``
    plus every character seen inside a word, then the most frequent merges (ties: the pair of
    smaller ids) with at least ``min_frequency`` occurrences, up to ``vocab_size``.
    """
    words: Counter[str] = Counter()
    for line in lines:
        text = tok.normalizer.normalize_str(line) if tok.normalizer is not None else line
        words.update(w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text))
    inside = sorted({c for w in words for c in w[1:]})
    to_private = _private_codes(inside, {c for w in words for c in w} | {c for s in specials for c in s})
    back = {p: c for c, p in to_private.items()}
    table = str.maketrans(to_private)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    firsts = sorted({c for w in words for c in w})  # every character is in the alphabet, as in WordPieceTrainer
    needed = len(specials) + len(firsts) + len(inside)
    if vocab_size < needed:  # the trainer keeps the alphabet whole: the vocabulary outgrows the key (said, not silent)
        logging.getLogger("tk.core.text.tokenizer").warning(
            "tokenizer: tokenizer.vocab_size is %d but the texts' alphabet alone needs %d wordpiece ids (%d characters, "
            "%d inside words as ##c, %d specials); raise tokenizer.vocab_size above it for any merges",
            vocab_size, needed, len(firsts), len(inside), len(specials))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=firsts, show_progress=False)
    bpe.train_from_iterator(_repeat(words, table), trainer)

    vocab = {}
    for piece, idx in bpe.get_vocab().items():
        if piece in specials:
            vocab[piece] = idx
        elif piece[0] in back:  # starts inside a word
            vocab["##" + "".join(back.get(c, c) for c in piece)] = idx
        else:
            vocab["".join(back.get(c, c) for c in piece)] = idx
    if unk not in vocab:
        raise TkError(f"wordpiece training lost the unknown token {unk!r}")  # a special: always kept
    model = models.WordPiece(vocab, unk_token=unk, continuing_subword_prefix="##")
    out = Tokenizer(model)
    out.normalizer, out.pre_tokenizer, out.decoder = tok.normalizer, tok.pre_tokenizer, tok.decoder
    out.add_special_tokens(specials)
    return out


def canonical_unigram(tok: Tokenizer, specials: list[str]) -> Tokenizer:
    """``tok``'s trained Unigram model, written the same way in every process: the characters at
    the lowest scores (the trainer appends the ones it must keep at ``min + k * 1e-4`` in map
    order) given those scores in character order, scores rounded to ``_SCORE_DIGITS`` decimals,
    and the pieces after the specials sorted by (score, piece)."""
    data = json.loads(tok.to_str())
    unk_id = data["model"].get("unk_id")
    unk = data["model"]["vocab"][unk_id][0] if unk_id is not None else None
    pieces = dict((p, s) for p, s in data["model"]["vocab"] if p not in specials)
    lowest = min(pieces.values(), default=0.0)
    tail: list[str] = []  # single characters at lowest, lowest + 1e-4, ... (no gap)
    for k in range(len(pieces)):
        at_k = [p for p, s in pieces.items() if len(p) == 1 and abs(s - lowest - k * _APPENDED_STEP) < 1e-9]
        if not at_k:
            break
        tail += at_k
    scores = sorted((pieces[p] for p in tail), reverse=True)
    pieces.update(zip(sorted(tail), scores))
    ordered = sorted(((p, round(s, _SCORE_DIGITS)) for p, s in pieces.items()), key=lambda ps: (-ps[1], ps[0]))
    head = [[p, s] for p, s in data["model"]["vocab"] if p in specials]
    data["model"]["vocab"] = head + [[p, s] for p, s in ordered]
    if unk is not None:
        data["model"]["unk_id"] = [p for p, _ in data["model"]["vocab"]].index(unk)
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def _private_codes(chars: list[str], taken: set[str]) -> dict[str, str]:
    """A private-use character for each of ``chars`` (sorted), in the same order, none of ``taken``."""
    free = (chr(c) for lo, hi in _PRIVATE for c in range(lo, hi + 1) if chr(c) not in taken)
    try:
        return {c: next(free) for c in chars}
    except StopIteration:
        raise TkError(f"wordpiece training: the texts hold {len(chars)} distinct characters inside words, more "
                      f"than the private-use code points left to stand for them; use tokenizer.kind=bpe") from None


def _repeat(words: Counter[str], table: dict[int, str]) -> Iterator[str]:
    """Each word (characters after the first mapped by ``table``) as many times as it was seen,
    in sorted order, in strings of about ``_FEED`` characters."""
    for word in sorted(words):
        mapped = word[0] + word[1:].translate(table)
        count = words[word]
        per = max(1, _FEED // (len(mapped) + 1))
        while count > 0:
            n = min(count, per)
            yield (mapped + " ") * n
            count -= n


def train_checked(tok: Tokenizer, batches: Iterable[list[str]], trainer: Any, cfg: Any) -> None:
    """``tok.train_from_iterator`` with a vocabulary below the texts' alphabet as one line (unigram: the
    trainer raises a bare ``Exception``).

    Raises:
        TkError: ``tokenizer.vocab_size`` cannot hold every character.
    """
    try:
        tok.train_from_iterator(batches, trainer)
    except Exception as e:  # tokenizers raises a bare Exception here
        if "not large enough" not in str(e):
            raise
        raise TkError(f"tokenizer.vocab_size ({cfg.vocab_size}) is smaller than the {cfg.kind} alphabet of the texts "
                      f"(every character needs an id); raise tokenizer.vocab_size") from e


def say_size(vocab_size: int, cfg: Any) -> None:
    """A trained vocabulary of another size than ``tokenizer.vocab_size``, said in train.log (wordpiece says
    its alphabet itself, in :func:`train_wordpiece`; char has no size)."""
    if cfg.kind not in ("char", "wordpiece") and vocab_size != cfg.vocab_size:
        why = "the alphabet and the specials need more" if vocab_size > cfg.vocab_size else \
            "the texts hold no more distinct pieces"
        logging.getLogger("tk.core.text.tokenizer").warning(
            "tokenizer: tokenizer.vocab_size is %d but the trained %s vocabulary has %d ids (%s)",
            cfg.vocab_size, cfg.kind, vocab_size, why)
