"""One tokenizer wrapper over Hugging Face ``tokenizers`` for every text task: char, byte-level
BPE, WordPiece or Unigram, trained from a stream of texts or loaded (tokenizer.json, a model
folder, a hub id), saved as a single tokenizer.json.

BPE: https://arxiv.org/abs/1508.07909, byte-level: GPT-2; WordPiece: https://arxiv.org/abs/1609.08144;
Unigram: https://arxiv.org/abs/1804.10959.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.implementations import BertWordPieceTokenizer

from tk.core.errors import TkError
from tk.core.text.reproducible import canonical_unigram, say_size, train_checked, train_wordpiece

__all__ = ["BERT_SPECIALS", "BERT_TEMPLATE", "Encoded", "Template", "TextTokenizer", "TokenizerConfig",
           "build_tokenizer"]

Kind = Literal["char", "bpe", "wordpiece", "unigram"]
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "gpt2", "openai-community/gpt2"
_KINDS = {"WordLevel": "char", "BPE": "bpe", "WordPiece": "wordpiece", "Unigram": "unigram"}
_BATCH = 1000  # lines per batch fed to a trainer
_CHAR_SPLIT = r"[\s\S]"  # the char kind's pre-tokenizer: any one character, newlines included


@dataclass
class TokenizerConfig:
    """The recipe's ``tokenizer:`` section, shared by every text task (subclass it to change
    defaults or add fields)."""

    kind: Kind = "bpe"  # char: one id per character seen; bpe: byte-level BPE; wordpiece (BERT); unigram
    vocab_size: int = 8000  # tokens incl. specials; bpe starts from the 256 bytes; char keeps every character seen
    path: str | None = None  # a tokenizer.json, a model folder (tokenizer.json or vocab.txt) or a hub id; null = train
    lowercase: bool = False  # lowercase the text first (wordpiece also strips accents)
    min_frequency: int = 2  # bpe/wordpiece: a merge or piece needs this many occurrences

    def check(self) -> list[str]:
        """Range checks, one line each naming the ``tokenizer.*`` key (the recipe loader runs them)."""
        problems = []
        if self.path is None and self.kind == "bpe" and self.vocab_size < 257:
            problems.append(f"tokenizer.vocab_size ({self.vocab_size}) must be >= 257 for kind bpe: byte-level BPE "
                            f"starts from the 256 bytes and adds the specials and merges on top")
        elif self.vocab_size < 1:
            problems.append(f"tokenizer.vocab_size ({self.vocab_size}) must be >= 1")
        if self.min_frequency < 0:
            problems.append(f"tokenizer.min_frequency ({self.min_frequency}) must be >= 0")
        return problems


@dataclass(frozen=True)
class Template:
    """Special tokens wrapped around one text (``single``) or a pair (``pair``), in the
    ``tokenizers`` TemplateProcessing syntax: ``$A``/``$B`` are the texts, ``:1`` a token-type id."""

    single: str
    pair: str | None = None


BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")  # [PAD] first: pad id 0
BERT_TEMPLATE = Template("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1")


@dataclass
class Encoded:
    """What :meth:`TextTokenizer.encode_batch` returns, one entry per example."""

    ids: list[list[int]]  # token ids
    type_ids: list[list[int]]  # token-type (segment) ids: 0 for text A, 1 for text B of a pair
    truncated: int  # how many examples were cut to max_length


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the few calls tasks need; ``.tok`` is the raw tokenizer.

    Build one with :meth:`train`, :meth:`load`, :meth:`from_str` or :func:`build_tokenizer`.
    Padding and truncation stored in a loaded file are turned off: batches are padded by the
    task's collate, and truncation is only what ``encode_batch(max_length=...)`` asks for.

    Args:
        tok: the tokenizer.
        source: where it came from, for error messages (a path, a hub id, "trained").
    """

    def __init__(self, tok: Tokenizer, source: str = "trained") -> None:
        self.tok, self.source = tok, source
        self.tok.no_padding()
        self.tok.no_truncation()
        self._chars = _char_table(tok)  # char kind: {character: id}, for the fast path

    # building ---------------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], cfg: TokenizerConfig, specials: Sequence[str] = (),
              template: Template | None = None, unk_token: str | None = None) -> TextTokenizer:
        """Train a ``cfg.kind`` tokenizer on a stream of texts (never joined: the trainer gets
        batches of lines, the char kind only keeps the set of characters).

        Args:
            texts: the training texts (documents or lines), read once.
            cfg: kind, vocab_size, lowercase, min_frequency (``path`` is not read here).
            specials: special tokens; they get ids 0, 1, ... in this order.
            template: special tokens added around each text by ``encode(add_special_tokens=True)``,
                e.g. :data:`BERT_TEMPLATE`; None = none.
            unk_token: the token of unknown input (char, wordpiece, unigram; byte-level BPE needs none); default:
                the first special containing "unk" (any case), else ``"<unk>"`` appended to ``specials``.

        Raises:
            TkError: unknown kind, or a template token missing from the vocabulary.
        """
        if cfg.kind not in ("char", "bpe", "wordpiece", "unigram"):
            raise TkError(f"tokenizer.kind: {cfg.kind!r} is not one of 'char', 'bpe', 'wordpiece', 'unigram'")
        specials = list(dict.fromkeys(specials))
        if cfg.kind != "bpe":
            unk_token = unk_token or next((s for s in specials if "unk" in s.lower()), "<unk>")
            specials += [] if unk_token in specials else [unk_token]
        if cfg.kind == "char":
            tok = _train_char(texts, specials, unk_token, cfg.lowercase)
        else:
            tok, trainer = _subword(cfg, specials, unk_token)
            if cfg.kind == "wordpiece":  # the same vocabulary in every process (see tk.core.text.reproducible)
                tok = train_wordpiece(tok, texts, cfg.vocab_size, cfg.min_frequency, specials, unk_token)
            else:
                train_checked(tok, _line_batches(texts), trainer, cfg)
                tok = canonical_unigram(tok, specials) if cfg.kind == "unigram" else tok
        out = cls(tok)
        if template is not None:
            out.set_template(template)
        say_size(out.vocab_size, cfg)  # a size other than asked: said in train.log, not silent
        return out

    @classmethod
    def load(cls, source: str | Path, required_specials: Sequence[str] = (), key: str = "tokenizer.path"
             ) -> TextTokenizer:
        """Load a tokenizer.json file; a model folder's tokenizer.json, else its vocab.txt (BERT
        WordPiece, lowercasing from tokenizer_config.json's ``do_lower_case``, default true);
        else a hub model id (``Tokenizer.from_pretrained``), only when no such path exists.

        Args:
            source: the file, folder or hub id.
            required_specials: tokens the task needs (e.g. its PAD/UNK).
            key: the recipe key named in errors.

        Raises:
            TkError: one line naming ``key``: nothing at ``source``, not a tokenizer, a folder
                without tokenizer.json/vocab.txt, the hub unreachable, or a required special missing.
        """
        name = str(source)
        path = Path(name).expanduser()
        if path.is_file():
            tok = _from_file(path, key)
        elif path.is_dir():
            tok = _from_folder(path, key)
        elif HUB_ID.fullmatch(name) and not name.endswith(".json"):
            try:
                tok = _from_hub(name)
            except Exception as e:  # no network, or no such repository
                raise TkError(f"{key}: {name!r} is not a file or folder here, and loading it as a hub model failed "
                              f"({_first_line(e)}); give a local tokenizer.json or model folder") from e
        else:
            raise TkError(f"{key}: tokenizer file not found: {name!r} does not exist; set {key} to a tokenizer.json, "
                          f"a model folder with tokenizer.json or vocab.txt, a hub model id, or null to train one")
        out = cls(tok, name)
        missing = [s for s in required_specials if tok.token_to_id(s) is None]
        if missing:
            raise TkError(f"{key}: tokenizer {name} lacks the special tokens {missing}; it needs "
                          f"{list(required_specials)}")
        return out

    @classmethod
    def from_str(cls, text: str, source: str = "tokenizer.json") -> TextTokenizer:
        """The tokenizer saved by :meth:`to_str` / :meth:`save` (a task file)."""
        return cls(Tokenizer.from_str(text), source)

    def to_str(self) -> str:
        """The tokenizer.json text (model, normaliser, specials, template: everything)."""
        return self.tok.to_str()

    def save(self, path: str | Path) -> None:
        """Write the tokenizer.json; :meth:`load` reads it back with the same kind and ids."""
        Path(path).write_text(self.to_str(), encoding="utf-8")

    def set_template(self, template: Template | None) -> None:
        """Use ``template`` when ``encode(add_special_tokens=True)``; None removes it.

        Raises:
            TkError: a token of the template is not in the vocabulary.
        """
        if template is None:
            self.tok.post_processor = None
            return
        pieces = f"{template.single} {template.pair or ''}".split()
        names = dict.fromkeys(p.split(":")[0] for p in pieces if not p.startswith("$"))
        self.tok.post_processor = processors.TemplateProcessing(
            single=template.single, pair=template.pair, special_tokens=[(t, self.token_id(t)) for t in names])

    # vocabulary ------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``char`` (a WordLevel model), ``bpe``, ``wordpiece`` or ``unigram``: the model family."""
        return _KINDS.get(type(self.tok.model).__name__, type(self.tok.model).__name__.lower())

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included (the embedding table's size)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[str, int]:
        """Each special token's id, e.g. ``{"[PAD]": 0, "[UNK]": 1, ...}``."""
        return {t.content: i for i, t in sorted(self.tok.get_added_tokens_decoder().items()) if t.special}

    def token_id(self, token: str) -> int:
        """The id of ``token``.

        Raises:
            TkError: the vocabulary has no such token (naming it and the tokenizer).
        """
        idx = self.tok.token_to_id(token)
        if idx is None:
            raise TkError(f"the tokenizer ({self.source}, {self.kind}) has no token {token!r}; "
                          f"its special tokens are {list(self.special_ids)}")
        return idx

    # encoding --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of one text (with the template's special tokens, if any and asked for)."""
        fast = self._char_ids([text], add_special_tokens, None)
        return fast[0] if fast is not None else self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], pairs: Sequence[str] | None = None,
                     add_special_tokens: bool = True, max_length: int | None = None) -> Encoded:
        """Encode many texts (or text pairs) at once, in parallel threads.

        Args:
            texts: the texts (text A of each pair).
            pairs: text B of each example, for pair classification; None = single texts.
            add_special_tokens: apply the template (e.g. ``[CLS] A [SEP] B [SEP]``), if any.
            max_length: cut each example to this many tokens, specials included (counted in
                ``Encoded.truncated``); None = no cut.

        Returns:
            :class:`Encoded` with ``ids``, ``type_ids`` and ``truncated``.
        """
        if pairs is None and (fast := self._char_ids(texts, add_special_tokens, max_length)) is not None:
            return Encoded(fast, [[0] * len(ids) for ids in fast], 0)
        inputs = list(texts) if pairs is None else list(zip(texts, pairs))
        if max_length is not None:
            self.tok.enable_truncation(max_length)
        try:
            encs = self.tok.encode_batch_fast(inputs, add_special_tokens=add_special_tokens)
        finally:
            self.tok.no_truncation()
        truncated = sum(1 for e in encs if e.overflowing) if max_length is not None else 0
        return Encoded([e.ids for e in encs], [e.type_ids for e in encs], truncated)

    def _char_ids(self, texts: Sequence[str], add_special_tokens: bool, max_length: int | None
                  ) -> list[list[int]] | None:
        """Char kind: the ids by a dict lookup per character (the ``tokenizers`` pipeline makes an
        Encoding per character, ~15x slower); None where that would differ from ``self.tok``
        (a template to apply, truncation, a special token's text inside a text)."""
        if self._chars is None or max_length is not None or (add_special_tokens and self.tok.post_processor):
            return None
        index, unk, specials = self._chars
        normalizer = self.tok.normalizer
        texts = [normalizer.normalize_str(t) for t in texts] if normalizer is not None else texts
        joined = "\0".join(texts)  # one substring search per special, not one per text
        if any(s in joined for s in specials):  # tokenizers matches specials first
            return None
        return [[index.get(c, unk) for c in t] for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (specials left out unless ``skip_special_tokens=False``)."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` of each id list."""
        return self.tok.decode_batch([list(i) for i in ids], skip_special_tokens=skip_special_tokens)


def build_tokenizer(cfg: TokenizerConfig, texts: Iterable[str], specials: Sequence[str] = (),
                    template: Template | None = None, key: str = "tokenizer.path") -> TextTokenizer:
    """What a task's ``setup`` does: load ``cfg.path`` (checking ``specials`` are in it) when
    set, else train on ``texts`` (pass a generator: it is not read when loading).

    A loaded tokenizer keeps its own normaliser and template unless ``template`` is given.
    """
    if cfg.path is None:
        return TextTokenizer.train(texts, cfg, specials, template)
    tok = TextTokenizer.load(cfg.path, required_specials=specials, key=key)
    if template is not None:
        tok.set_template(template)
    return tok


# helpers --------------------------------------------------------------------------------------
def _train_char(texts: Iterable[str], specials: list[str], unk: str, lowercase: bool) -> Tokenizer:
    """A WordLevel model over single characters: specials first, then the characters sorted."""
    normalizer = normalizers.Lowercase() if lowercase else None
    chars: set[str] = set()
    for text in texts:
        chars.update(normalizer.normalize_str(text) if normalizer else text)
    vocab = {s: i for i, s in enumerate(specials)}
    for c in sorted(chars - set(specials)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_CHAR_SPLIT), behavior="isolated")  # every char, newlines too
    tok.decoder = decoders.Fuse()  # concatenate the characters back
    tok.add_special_tokens(specials)
    return tok


def _char_table(tok: Tokenizer) -> tuple[dict[str, int], int, list[str]] | None:
    """``(vocab, unk id, specials)`` of a char tokenizer made by :func:`_train_char`, else None."""
    if not isinstance(tok.model, models.WordLevel):
        return None
    data = json.loads(tok.to_str())
    split = data.get("pre_tokenizer") or {}
    if split.get("type") != "Split" or split.get("pattern") != {"Regex": _CHAR_SPLIT}:
        return None
    vocab = data["model"]["vocab"]
    specials = [t["content"] for t in data["added_tokens"]]
    return vocab, vocab.get(data["model"]["unk_token"], 0), specials


def _subword(cfg: TokenizerConfig, specials: list[str], unk: str | None) -> tuple[Tokenizer, trainers.Trainer | None]:
    """An untrained bpe / wordpiece / unigram tokenizer and its trainer."""
    common = {"vocab_size": cfg.vocab_size, "special_tokens": specials, "show_progress": False}
    lower = [normalizers.Lowercase()] if cfg.lowercase else []
    if cfg.kind == "bpe":  # byte-level: any text round-trips exactly, no unknowns
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Sequence(lower) if lower else None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok, trainers.BpeTrainer(min_frequency=cfg.min_frequency,
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), **common)
    if cfg.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=unk))
        tok.normalizer = normalizers.BertNormalizer(lowercase=cfg.lowercase, strip_accents=cfg.lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        return tok, None  # trained by train_wordpiece
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), *lower])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok, trainers.UnigramTrainer(unk_token=unk, **common)


def _line_batches(texts: Iterable[str], size: int = _BATCH) -> Iterator[list[str]]:
    """Lists of ``size`` lines (newlines kept, so byte-level BPE learns them)."""
    batch: list[str] = []
    for text in texts:
        for line in text.splitlines(keepends=True):
            batch.append(line)
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch


def _from_file(path: Path, key: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception on bad JSON
        raise TkError(f"{key}: {path} is not a tokenizers tokenizer.json ({_first_line(e)}); give the "
                      f"tokenizer.json of a tokenizers/transformers tokenizer") from e


def _from_folder(folder: Path, key: str) -> Tokenizer:
    if (folder / "tokenizer.json").is_file():
        return _from_file(folder / "tokenizer.json", key)
    if (folder / "vocab.txt").is_file():
        lower, config = True, folder / "tokenizer_config.json"
        if config.is_file():
            try:
                lower = bool(json.loads(config.read_text(encoding="utf-8")).get("do_lower_case", True))
            except ValueError as e:
                raise TkError(f"{key}: {config} is not valid JSON ({e}); fix or delete it") from e
        return BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=lower)._tokenizer
    raise TkError(f"{key}: folder {folder} has neither tokenizer.json nor vocab.txt; give a model folder "
                  f"that has one, or a tokenizer.json file")


def _from_hub(name: str) -> Tokenizer:
    """The hub model's tokenizer.json (downloaded by ``tokenizers``; a seam for tests)."""
    return Tokenizer.from_pretrained(name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
