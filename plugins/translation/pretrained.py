"""``model.pretrained_from`` for translation: a Hugging Face translator (a ``save_pretrained``
folder or a hub id) of a family tk maps (:mod:`tk.core.exchange.hf.seq2seq`: Marian/opus-mt,
M2M100/NLLB-200). Its shape, its tokenizers (Marian's SentencePiece models, NLLB's
``tokenizer.json``), how it frames a pair (decoder start, language codes) and its generation
defaults are kept as task files, so resume, ``tk translate``, eval and export need the folder no more."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from tk.core.artifacts import TaskFiles
from tk.core.errors import TkError
from tk.core.exchange.hf.bert import resolve_pretrained_dir
from tk.core.exchange.hf.decoders import resolve_dtype
from tk.core.exchange.hf.folder import WeightFiles, read_config, read_json
from tk.core.exchange.hf.seq2seq import load_seq2seq, seq2seq_config
from tk.core.exchange.pretrained import RECORD_FILE
from tk.core.text import TextTokenizer
from tk.core.text.sentencepiece import MarianVocab
from tk.plugins.translation.data import Framing

HF_CONFIG_FILE = "hf_config.json"  # task file: the source's config.json (what export writes back)
GENERATION_FILE = "generation_config.json"
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json")
FAST_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
KEY = "model.pretrained_from"
log = logging.getLogger(__name__)


def source_problem(spec: str) -> str | None:
    """What is wrong with ``spec`` as a translator source before it is read (None: a Hugging Face
    folder, or a hub id that is no path on disk, to be opened)."""
    path = Path(spec).expanduser()
    if (path / "config.yaml").is_file() or path.suffix == ".pt":
        return (f"{KEY}: {spec} is a tk run; translation starts from a Hugging Face translator (a Marian/opus-mt "
                f"or NLLB folder or hub id); continue a tk run with tk run --resume")
    if path.is_file():
        return (f"{KEY}: {spec} is a file; give the folder transformers' save_pretrained wrote (config.json, "
                f"model.safetensors, the tokenizer files) or a hub id")
    return None


class Translator:
    """An opened translator folder: its config, tk fields, vocabulary and weight headers."""

    def __init__(self, spec: str) -> None:
        """Raises: TkError for a folder that is not a translator tk maps, before anything heavy."""
        self.spec = spec
        problem = source_problem(spec)
        if problem:
            raise TkError(problem)
        self.folder = resolve_pretrained_dir(spec)
        self.config = read_config(self.folder)
        if not self.config.get("is_encoder_decoder", True) or "d_model" not in self.config:
            kind = self.config.get("model_type")
            seq2seq_config(self.config)  # names a decoder-only family as such
            raise TkError(f"{KEY}: {self.folder} holds a {kind!r} model that is not a seq2seq translator")
        self.fields, self.vocab_size = seq2seq_config(self.config)
        self.files = WeightFiles(self.folder)

    def tokenizers(self) -> tuple[Any, Any]:
        """(source, target) tokenizers of the folder.

        Raises:
            TkError: the family's tokenizer files are missing, or hold more ids than the embedding.
        """
        return tokenizers_of(self.config, {n: (self.folder / n).read_bytes() for n in MARIAN_FILES + FAST_FILES
                                           if (self.folder / n).is_file()}, str(self.folder), self.vocab_size)

    def keep_files(self, files: TaskFiles, adopted: dict[str, Any]) -> None:
        """The tokenizer and generation files, the config and the record, as task files."""
        if files.dir is None:
            return
        for name in MARIAN_FILES + FAST_FILES + (GENERATION_FILE,):
            if (self.folder / name).is_file() and not files.exists(name):
                files.write_bytes(name, (self.folder / name).read_bytes())
        files.write_text(HF_CONFIG_FILE, json.dumps(self.config, indent=1))
        record = {"from": self.spec, "checkpoint": str(self.folder), "task": f"hf:{self.config['model_type']}",
                  "model": adopted}
        files.write_text(RECORD_FILE, json.dumps(record, indent=1))

    def generation(self) -> dict[str, Any]:
        return read_json(self.folder, GENERATION_FILE)

    def build(self, build: Any, dtype_spec: str) -> torch.nn.Module:
        """The model with the folder's weights (built on the meta device, read tensor by tensor)."""
        dtype = resolve_dtype(dtype_spec, self.files, self.config)
        model = load_seq2seq(build, self.folder, dtype, self.config)
        log.info("model.pretrained_from: %s (%s, %d tensors, %.1f MB of weights) loaded as %s", self.spec,
                 self.config["model_type"], len(model.state_dict()), self.files.nbytes() / 1e6,
                 str(dtype).removeprefix("torch."))
        drops = {k: self.config.get(k) for k in ("encoder_layerdrop", "decoder_layerdrop") if self.config.get(k)}
        if drops:  # a training-time option only: the model computes the same, fine-tuning keeps every layer
            log.warning("model.pretrained_from: %s has %s; tk does not drop layers (LayerDrop): fine-tuning runs "
                        "every layer, translation is unaffected", self.spec,
                        ", ".join(f"{k} {v}" for k, v in drops.items()))
        return model


def tokenizers_of(config: dict[str, Any], found: dict[str, bytes], where: str, vocab_size: int) -> tuple[Any, Any]:
    """(source, target) tokenizers from the family's files ``found`` (name -> bytes).

    Raises:
        TkError: a missing file, named with the fix; more ids than the model's embedding has rows.
    """
    if config.get("model_type") == "marian":
        missing = [n for n in MARIAN_FILES[:3] if n not in found]
        if missing:
            raise TkError(f"{KEY}: {where} has no {', '.join(missing)}: a Marian model's tokenizer is its two "
                          f"SentencePiece models and vocab.json; copy them beside config.json (save the tokenizer "
                          f"with MarianTokenizer.save_pretrained)")
        vocab = MarianVocab.from_files(found)
        src, tgt = vocab.source, vocab.target
    else:
        if "tokenizer.json" not in found:
            raise TkError(f"{KEY}: {where} has no tokenizer.json; tk reads the fast tokenizer's file (NLLB ships one; "
                          f"for M2M100 save NllbTokenizerFast/M2M100 tokenizers as a fast tokenizer)")
        src = tgt = TextTokenizer.from_str(found["tokenizer.json"].decode("utf-8"), f"{where}/tokenizer.json")
    if tgt.vocab_size > vocab_size:
        raise TkError(f"{KEY}: the tokenizer has {tgt.vocab_size} ids but the model's embedding only {vocab_size} "
                      f"rows (config.json vocab_size); they are not one model's files")
    return src, tgt


def saved_tokenizers(files: TaskFiles) -> tuple[Any, Any]:
    """The run's kept tokenizers (a resumed, evaluated or translating run)."""
    config = json.loads(files.read_text(HF_CONFIG_FILE))
    found = {n: files.path(n).read_bytes() for n in MARIAN_FILES + FAST_FILES if files.exists(n)}
    return tokenizers_of(config, found, str(files.path(HF_CONFIG_FILE).parent), int(config["vocab_size"]))


def saved_generation(files: TaskFiles) -> dict[str, Any]:
    return json.loads(files.read_text(GENERATION_FILE)) if files.exists(GENERATION_FILE) else {}


def _code_id(tok: Any, code: str, key: str, model_type: str) -> int:
    try:
        return tok.token_id(code)
    except TkError:
        pass
    known = sorted(language_codes(tok, model_type))
    shown = ", ".join(known[:8]) + (f", ... ({len(known)} in all)" if len(known) > 8 else "")
    raise TkError(f"{key}: {code!r} is not a language code of this {model_type} model"
                  + (f"; it knows {shown}" if known else "; it has no language codes (remove the key)"))


def language_codes(tok: Any, model_type: str) -> list[str]:
    """The language tokens of a tokenizer: Marian's ``>>xx<<``, NLLB's ``eng_Latn``-style specials."""
    vocab = tok.tok.get_vocab(with_added_tokens=True) if hasattr(tok, "tok") else getattr(tok, "_vocab", {})
    if model_type == "marian":
        return [t for t in vocab if t.startswith(">>") and t.endswith("<<")]
    return [t for t in vocab if len(t) == 8 and t[3] == "_" and t[:3].isalpha()]


def framing_of(config: dict[str, Any], generation: dict[str, Any], src_tok: Any, src_code: str | None,
               tgt_code: str | None) -> Framing:
    """The family's framing of a pair with the run's language codes.

    Raises:
        TkError: a code the model does not know; a multilingual NLLB model without codes.
    """
    kind = config["model_type"]
    get = lambda k: generation.get(k, config.get(k))  # noqa: E731  generation_config.json wins, as in transformers
    pad, eos, start = int(get("pad_token_id")), int(get("eos_token_id")), int(get("decoder_start_token_id"))
    src_prefix, tgt_prefix, forced = (), (), None
    if kind == "marian":
        if src_code is not None:
            raise TkError(f"data.src_code: a Marian model reads no source language code; remove it (a multilingual "
                          f"opus-mt model takes the target's >>xx<< code as data.tgt_code)")
        if tgt_code is not None:  # multilingual opus-mt: >>deu<< before the source text
            src_prefix = (_code_id(src_tok, tgt_code, "data.tgt_code", kind),)
    else:
        if src_code is None or tgt_code is None:
            raise TkError(f"data.src_code and data.tgt_code: a {kind} model translates between the languages it is "
                          f"told; set both (NLLB: e.g. eng_Latn and deu_Latn)")
        src_prefix = (_code_id(src_tok, src_code, "data.src_code", kind),)
        forced = _code_id(src_tok, tgt_code, "data.tgt_code", kind)
        tgt_prefix = (forced,)
    forced_eos = get("forced_eos_token_id") is not None
    return Framing(pad, start, eos, src_prefix, tgt_prefix, forced, forced_eos, dict(generation))
