"""Encoding one long text (a corpus file) on every core: ``tokenizers`` parallelises over the
texts of a batch, not within one text, so the text is cut into pieces where no tokenizer kind
joins across the cut and the pieces are encoded as a batch."""

from __future__ import annotations

import re

from tk.core.text.tokenizer import TextTokenizer

__all__ = ["encode_long"]

# between a non-space character and a single-space-led word: byte-level BPE starts a pre-token at
# the space (" word"), WordPiece splits on it, Metaspace (Unigram) turns it into the "▁" its pieces
# start with and adds no other "▁" to a piece that starts with one, char splits everywhere
_CUT = re.compile(r"(?<=\S)(?= \S)")
_PIECE = 1 << 16  # characters per piece (before moving to the next cut)


def encode_long(tokenizer: TextTokenizer, text: str, piece: int = _PIECE) -> list[int]:
    """The same ids as ``tokenizer.encode(text)`` (tested for every kind), 2-4x faster on two
    cores for the subword kinds. A tokenizer with a template (special tokens around a text) or
    of the char kind (its own fast path) encodes the text whole."""
    if tokenizer.kind == "char" or len(text) <= piece or tokenizer.tok.post_processor is not None:
        return tokenizer.encode(text)
    pieces, start = [], 0
    while start < len(text):
        cut = _CUT.search(text, min(len(text), start + piece)) if start + piece < len(text) else None
        end = cut.start() if cut else len(text)
        pieces.append(text[start:end])
        start = end
    return [i for ids in tokenizer.encode_batch(pieces, add_special_tokens=False).ids for i in ids]
