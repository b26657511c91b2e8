"""Training (WordPiece or BPE), loading and applying the task's ``tokenizers`` tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.implementations import BertWordPieceTokenizer

from tk.core.errors import TkError

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]  # [PAD] first: pad id 0


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int, lowercase: bool) -> Tokenizer:
    """A WordPiece or BPE tokenizer trained on ``texts``, with BERT's [CLS] A [SEP] (B [SEP]) template."""
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
        tok.decoder = decoders.WordPiece()
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def load_pretrained_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder: ``tokenizer.json``, else ``vocab.txt`` (BERT
    WordPiece; lowercasing from ``tokenizer_config.json``'s ``do_lower_case``, default true).

    Raises:
        TkError: the folder has neither file.
    """
    folder = Path(folder).expanduser()
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    if (folder / "vocab.txt").is_file():
        lower = True
        if (folder / "tokenizer_config.json").is_file():
            lower = json.loads((folder / "tokenizer_config.json").read_text()).get("do_lower_case", True)
        return BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=lower)._tokenizer
    raise TkError(f"model.pretrained_dir: {folder} has neither tokenizer.json nor vocab.txt")


def special_id(tok: Tokenizer, token: str) -> int:
    """Id of a special token; TkError naming it when the vocabulary lacks it."""
    idx = tok.token_to_id(token)
    if idx is None:
        raise TkError(f"the tokenizer has no {token} token; a BERT-style vocabulary needs {', '.join(SPECIALS)}")
    return idx


def encode(tok: Tokenizer, texts: Sequence[str], pairs: Sequence[str] | None, max_len: int
           ) -> tuple[list[list[int]], list[list[int]], int]:
    """Token ids and token-type ids of each example, truncated to ``max_len`` tokens.

    Returns:
        ``(ids, types, truncated)``: per-example lists, and how many examples were cut.
    """
    tok.no_padding()
    tok.enable_truncation(max_len)
    inputs = list(texts) if pairs is None else list(zip(texts, pairs))
    encs = tok.encode_batch(inputs)
    truncated = sum(1 for e in encs if e.overflowing)
    return [e.ids for e in encs], [e.type_ids for e in encs], truncated
