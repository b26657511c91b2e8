"""Marian (Helsinki-NLP opus-mt) tokenizer files, read without transformers: the same ids and
texts as transformers' ``MarianTokenizer`` with one shared vocabulary.

A Marian folder holds two SentencePiece models (``source.spm``, ``target.spm``) and one
``vocab.json`` mapping pieces to the model's ids (Marian's ids are not the SentencePiece ids).
Encoding: the text is split on the special tokens (``</s>``, ``<unk>``, ``<pad>`` written in
it), a leading language code ``>>xx<<`` of each part is kept whole, the rest goes through
SentencePiece, and pieces missing from ``vocab.json`` become ``<unk>``; ``</s>`` ends the ids.
SentencePiece: https://arxiv.org/abs/1808.06226.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tk.core.errors import TkError
from tk.core.text.tokenizer import Encoded

__all__ = ["MarianVocab", "SpmSide"]

REQUIRED = ("source.spm", "target.spm", "vocab.json")
CONFIG = "tokenizer_config.json"
_SPACE = "\u2581"  # SentencePiece's word-boundary mark
_HINT = "give the folder of a Helsinki-NLP opus-mt model (source.spm, target.spm, vocab.json)"


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (applied when the config asks for it)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


def _load_spm(proto: bytes, name: str) -> Any:
    """A SentencePieceProcessor of the serialised model ``proto`` (``name`` for errors)."""
    try:
        import sentencepiece  # lazily: `import tk` must not pay for it
    except ImportError as e:
        raise TkError("Marian tokenizers need the sentencepiece package: pip install sentencepiece") from e
    try:
        return sentencepiece.SentencePieceProcessor(model_proto=proto)
    except Exception as e:  # sentencepiece raises RuntimeError with a C++ trace
        raise TkError(f"{name} is not a SentencePiece model ({type(e).__name__}); {_HINT}") from e


class SpmSide:
    """One side (source or target) of a Marian tokenizer, with the calls of
    :class:`~tk.core.text.tokenizer.TextTokenizer` that translation uses.

    Args:
        proto: the serialised SentencePiece model (``source.spm`` or ``target.spm``).
        vocab: ``vocab.json``: piece -> id, shared by both sides.
        specials: the eos, unk and pad tokens, in this order.
        clean_up: apply transformers' ``clean_up_tokenization`` when decoding.
        source: where it came from, for error messages.
    """

    def __init__(self, proto: bytes, vocab: dict[str, int], specials: Sequence[str], clean_up: bool = False,
                 source: str = "source.spm") -> None:
        self.source, self.clean_up = source, clean_up
        self._proto, self._sp = proto, _load_spm(proto, source)
        self._vocab = vocab
        self._pieces = {i: p for p, i in vocab.items()}  # the last piece wins on a shared id, as in transformers
        self.eos_id, self.unk_id, self.pad_id = (vocab[s] for s in specials)
        self._specials, self._unk = list(dict.fromkeys(specials)), specials[1]
        longest_first = sorted(self._specials, key=len, reverse=True)  # a special inside another stays whole
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers: send the model bytes, not the C++ object
        return {k: v for k, v in self.__dict__.items() if k != "_sp"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sp = _load_spm(self._proto, self.source)

    # vocabulary ------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """Always ``"sentencepiece"``."""
        return "sentencepiece"

    @property
    def vocab_size(self) -> int:
        """Number of ids of ``vocab.json`` (its largest id + 1: the embedding table's size)."""
        return max(self._vocab.values()) + 1

    @property
    def special_ids(self) -> dict[str, int]:
        """The eos, unk and pad tokens' ids, e.g. ``{"</s>": 0, "<unk>": 1, "<pad>": 58100}``."""
        return dict(sorted(((s, self._vocab[s]) for s in self._specials), key=lambda kv: kv[1]))

    def token_id(self, token: str) -> int:
        """The id of ``token`` in ``vocab.json``.

        Raises:
            TkError: ``vocab.json`` has no such token (naming it).
        """
        if token not in self._vocab:
            raise TkError(f"the Marian tokenizer ({self.source}) has no token {token!r}; its special tokens are "
                          f"{list(self.special_ids)}")
        return self._vocab[token]

    # encoding --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of one text, ``</s>`` appended when ``add_special_tokens``."""
        return self.encode_batch([text], add_special_tokens=add_special_tokens).ids[0]

    def encode_batch(self, texts: Sequence[str], pairs: None = None, add_special_tokens: bool = True,
                     max_length: int | None = None) -> Encoded:
        """Encode many texts (SentencePiece runs them in one multi-threaded call).

        Args:
            texts: the texts.
            pairs: must be None (Marian encodes single texts; kept for TextTokenizer's signature).
            add_special_tokens: append ``</s>``.
            max_length: cut each example to this many ids, ``</s>`` included and kept last (as
                MarianTokenizer's ``truncation=True``); counted in ``Encoded.truncated``.
        """
        if pairs is not None:
            raise TkError("a Marian tokenizer encodes single texts, not text pairs")
        if max_length is not None and max_length < 1:
            raise TkError(f"max_length ({max_length}) must be >= 1")
        plans = [self._plan(t) for t in texts]
        pieces = iter(self._sp.encode([part for plan in plans for _, part in plan], out_type=str))
        ids, truncated, unk = [], 0, self.unk_id
        for plan in plans:
            row: list[int] = []
            for head, _ in plan:
                row += head
                row += [self._vocab.get(p, unk) for p in next(pieces)]  # pieces vocab.json lacks: <unk>
            if max_length is not None and len(row) + add_special_tokens > max_length:
                row, truncated = row[:max(max_length - add_special_tokens, 0)], truncated + 1
            ids.append(row + [self.eos_id] if add_special_tokens else row)
        return Encoded(ids, [[0] * len(row) for row in ids], truncated)

    def _plan(self, text: str) -> list[tuple[list[int], str]]:
        """``text`` as (ids given directly, text for SentencePiece) parts: a special token written
        in the text is its id; a part starting ``>>`` up to the first ``<<`` is a language code,
        looked up whole (its id, or <unk>), and SentencePiece never sees it."""
        plan = []
        for part in self._split.split(text):
            if part in self._specials:
                plan.append(([self._vocab[part]], ""))
            elif part.startswith(">>") and (end := part.find("<<") + 2) > 1:
                plan.append(([self._vocab.get(part[:end], self.unk_id)], part[end:]))
            elif part:
                plan.append(([], part))
        return plan

    # decoding --------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (eos, unk and pad left out unless ``skip_special_tokens=False``).

        Raises:
            TkError: an id is in neither ``vocab.json`` nor the SentencePiece model.
        """
        skip = set(self.special_ids.values()) if skip_special_tokens else set()
        out, run = "", []
        for piece in (self._piece(int(i)) for i in ids if int(i) not in skip):
            if piece in self._specials:  # written as is, never given to SentencePiece
                out, run = out + self._sp.decode_pieces(run) + piece + " ", []
            else:
                run.append(piece)
        out = (out + self._sp.decode_pieces(run)).replace(_SPACE, " ").strip()
        return _clean_up(out) if self.clean_up else out

    def decode_batch(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` of each id list."""
        return [self.decode(row, skip_special_tokens) for row in ids]

    def _piece(self, i: int) -> str:
        if i in self._pieces:
            return self._pieces[i]
        if 0 <= i < self._sp.get_piece_size():  # a gap in vocab.json: transformers asks SentencePiece
            return self._sp.id_to_piece(i) or self._unk
        raise TkError(f"id {i} is outside the Marian vocabulary ({self.source}: {self.vocab_size} ids)")


class MarianVocab:
    """Marian's tokenizer files: source.spm encodes sources, target.spm encodes/decodes targets,
    vocab.json maps pieces to the model's ids.

    Build it with :meth:`from_folder` or :meth:`from_files`; :meth:`files` gives the bytes back.

    Raises (on building):
        TkError: one line: a file missing or unreadable, ``separate_vocabs`` (not supported), a
            special token missing from vocab.json.
    """

    def __init__(self, files: dict[str, bytes], where: str = "the Marian files") -> None:
        if missing := [name for name in REQUIRED if name not in files]:
            raise TkError(f"{where}: {missing[0]} is missing; {_HINT}")
        self._files = {name: bytes(files[name]) for name in (*REQUIRED, CONFIG) if name in files}
        config = self._json(CONFIG, where) if CONFIG in files else {}
        vocab = self._json("vocab.json", where)
        if not isinstance(config, dict) or not isinstance(vocab, dict) or not vocab or \
                not all(isinstance(i, int) for i in vocab.values()):
            raise TkError(f"{where}: vocab.json must map pieces to int ids and {CONFIG} must be an object; {_HINT}")
        if config.get("separate_vocabs"):
            raise TkError(f"{where}: separate_vocabs=true (a second, target vocabulary) is not supported; tk supports "
                          f"the shared vocabulary of opus-mt models")
        named = [config.get(k) or d for k, d in (("eos_token", "</s>"), ("unk_token", "<unk>"), ("pad_token", "<pad>"))]
        specials = [str(t["content"] if isinstance(t, dict) else t) for t in named]  # a saved AddedToken: its content
        if absent := [s for s in specials if s not in vocab]:
            raise TkError(f"{where}: vocab.json lacks the special token {absent[0]!r}; {_HINT}")
        clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self.source = SpmSide(self._files["source.spm"], vocab, specials, clean_up, f"{where}/source.spm")
        self.target = SpmSide(self._files["target.spm"], vocab, specials, clean_up, f"{where}/target.spm")
        self.eos_id, self.unk_id, self.pad_id = self.source.eos_id, self.source.unk_id, self.source.pad_id
        self.language_codes = [p for p in vocab if p.startswith(">>") and p.endswith("<<")]

    @classmethod
    def from_folder(cls, folder: str | Path) -> MarianVocab:
        """Read source.spm, target.spm, vocab.json (and tokenizer_config.json, if there) of a
        Marian model folder (e.g. a Helsinki-NLP/opus-mt-* download)."""
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise TkError(f"Marian tokenizer: {str(folder)!r} is not a folder; {_HINT}")
        files = {}
        for name in (*REQUIRED, *([CONFIG] if (path / CONFIG).exists() else [])):  # the config is optional
            file = path / name
            if not file.is_file():
                raise TkError(f"Marian tokenizer folder {path} has no {name}; {_HINT}")
            try:
                files[name] = file.read_bytes()
            except OSError as e:
                raise TkError(f"Marian tokenizer folder {path}: cannot read {name} ({e.strerror or e}); "
                              f"check its permissions, or {_HINT}") from e
        return cls(files, str(path))

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> MarianVocab:
        """The inverse of :meth:`files` (e.g. from a run's task files)."""
        return cls(files)

    def files(self) -> dict[str, bytes]:
        """The files as read, byte for byte: source.spm, target.spm, vocab.json and
        tokenizer_config.json (when there was one)."""
        return dict(self._files)

    def _json(self, name: str, where: str) -> Any:
        try:
            return json.loads(self._files[name].decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise TkError(f"{where}: {name} is not valid UTF-8 JSON ({str(e).splitlines()[0]}); {_HINT}") from e
