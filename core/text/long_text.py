"""Encoding one long text (a corpus file) on every core: ``tokenizers`` parallelises over the
texts of a batch, not within one text, so the text is cut into pieces where no tokenizer kind
joins across the cut and the pieces are encoded as a batch. The same cuts let a corpus larger
than memory be read in chunks and encoded piece by piece (:func:`cut_pieces`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from tk.core.text.tokenizer import TextTokenizer

__all__ = ["adds_specials", "cut_pieces", "encode_long"]

# between a non-space character and a single-space-led word: byte-level BPE starts a pre-token at
# the space (" word"), WordPiece splits on it, Metaspace (Unigram) turns it into the "▁" its pieces
# start with and adds no other "▁" to a piece that starts with one, char splits everywhere
_CUT = re.compile(r"(?<=\S)(?= \S)")
_PIECE = 1 << 16  # characters per piece (before moving to the next cut)


def cut_pieces(chunks: Iterable[str], piece: int | None = None, anywhere: bool = False) -> Iterator[str]:
    """The text of ``chunks`` (joined) cut again into pieces of at least ``piece`` characters,
    each ending at the first cut after that (``anywhere``: exactly ``piece``, for the char kind):
    encoding the pieces one by one gives the ids of the whole text, and training a tokenizer on
    them gives the tokenizer of the whole text. Only one piece and one chunk are held at a time
    (unless the text has no cut for long: a text without spaces is held until it has one).
    ``piece`` defaults to 65,536 characters."""
    piece = piece or _PIECE
    buf, scanned = "", 0  # scanned: where the search for a cut goes on (earlier positions had none)
    for chunk in chunks:
        buf += chunk
        while len(buf) > piece:
            if anywhere:
                end = piece
            else:
                cut = _CUT.search(buf, max(piece, scanned))
                if cut is None:
                    scanned = max(piece, len(buf) - 1)  # the last character may start a cut with the next chunk
                    break
                end = cut.start()
            yield buf[:end]
            buf, scanned = buf[end:], 0
    if buf:
        yield buf


def adds_specials(tokenizer: TextTokenizer) -> bool:
    """Whether encoding a text adds special tokens around it (a template such as BERT's
    ``[CLS] $A [SEP]``; GPT-2's byte-level post-processor adds none): such a text is encoded whole."""
    post = None if tokenizer.kind == "char" else tokenizer.tok.post_processor
    return post is not None and post.num_special_tokens_to_add(False) > 0


def encode_long(tokenizer: TextTokenizer, text: str, piece: int = _PIECE) -> list[int]:
    """The same ids as ``tokenizer.encode(text)`` (tested for every kind), 2-4x faster on two
    cores for the subword kinds. A tokenizer with a template (special tokens around a text) or
    of the char kind (its own fast path) encodes the text whole."""
    if tokenizer.kind == "char" or len(text) <= piece or adds_specials(tokenizer):
        return tokenizer.encode(text)
    pieces = list(cut_pieces([text], piece))
    return [i for ids in tokenizer.encode_batch(pieces, add_special_tokens=False).ids for i in ids]
