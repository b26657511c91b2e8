"""``model.pretrained_from`` = a Hugging Face decoder (a ``save_pretrained`` folder or a hub id), for
any task whose model is the core ``DecoderOnlyLM`` (language_model, sft): the shape from its
``config.json``, its tokenizer and generation settings, kept as task files so that resume,
generation, ``tk eval`` and ``tk export --format hf`` need the folder no more."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tk.core.artifacts import TaskFiles
from tk.core.exchange.pretrained import RECORD_FILE, TRANSFORMER_SHAPE_KEYS, adopt_shape
from tk.core.errors import TkError
from tk.core.exchange.hf.bert import is_hub_id, resolve_pretrained_dir
from tk.core.exchange.hf.decoders import decoder_config, load_decoder, resolve_dtype
from tk.core.exchange.hf.folder import TOKENIZER_FILES, WeightFiles, is_hf_folder, read_config, read_json
from tk.core.nn.generation import GenerationConfig
from tk.core.text import TextTokenizer

HF_CONFIG_FILE = "hf_config.json"  # task file: the source's config.json (what export writes back)
log = logging.getLogger(__name__)


def is_hf_source(spec: str | None) -> bool:
    """A Hugging Face folder, or a hub id that is no path on disk."""
    if spec is None:
        return False
    path = Path(spec).expanduser()
    return is_hf_folder(path) or (not path.exists() and is_hub_id(spec))


@dataclass
class HFSource:
    """An opened decoder folder: its config, tk fields, vocabulary and weights (headers read)."""

    spec: str
    folder: Path
    config: dict[str, Any]
    fields: dict[str, Any]
    vocab_size: int
    files: WeightFiles

    @classmethod
    def open(cls, spec: str) -> HFSource:
        """Raises: TkError for every bad input, before anything heavy (see the issue's list)."""
        folder = resolve_pretrained_dir(spec)
        config = read_config(folder)
        fields, vocab = decoder_config(config)
        return cls(spec, folder, config, fields, vocab, WeightFiles(folder))

    def tokenizer(self) -> TextTokenizer:
        """The folder's ``tokenizer.json``, checked against the embedding.

        Raises:
            TkError: no tokenizer.json, or more ids than the embedding has rows.
        """
        if not (self.folder / "tokenizer.json").is_file():
            raise TkError(f"model.pretrained_from: {self.folder} has no tokenizer.json (tk reads the fast tokenizer's "
                          f"file; save the tokenizer with transformers' save_pretrained)")
        tok = TextTokenizer.load(self.folder / "tokenizer.json", key="model.pretrained_from")
        if tok.vocab_size > self.vocab_size:
            raise TkError(f"model.pretrained_from: the tokenizer has {tok.vocab_size} ids but the model's embedding "
                          f"only {self.vocab_size} rows (config.json vocab_size); they are not one model's files")
        return tok

    def adopt(self, model_cfg: Any, given: Any, block_size: int) -> Any:
        """``model_cfg`` with the folder's shape (recipe keys that disagree: one line each).

        Raises:
            TkError: a disagreeing key, or ``data.block_size`` beyond the model's positions.
        """
        cfg = adopt_shape(model_cfg, self.fields, TRANSFORMER_SHAPE_KEYS, given)
        if block_size > cfg.max_len:
            raise TkError(f"data.block_size ({block_size}) exceeds the model's {cfg.max_len} positions "
                          f"(config.json max_position_embeddings / n_positions); lower data.block_size")
        return cfg

    def keep_files(self, files: TaskFiles, adopted: dict[str, Any]) -> None:
        """The tokenizer and generation files, the config and the record, as task files."""
        if files.dir is None:
            return
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file() and not files.exists(name):
                files.write_text(name, (self.folder / name).read_text(encoding="utf-8"))
        files.write_text(HF_CONFIG_FILE, json.dumps(self.config, indent=1))
        record = {"from": self.spec, "checkpoint": str(self.folder), "task": f"hf:{self.config['model_type']}",
                  "model": adopted}
        files.write_text(RECORD_FILE, json.dumps(record, indent=1))

    def build(self, build: Any, dtype_spec: str, sharded: bool = False) -> torch.nn.Module:
        """The model with the folder's weights; ``sharded`` (FSDP over several processes): left on the
        meta device, each process reading only its shards once FSDP has sharded it."""
        dtype = resolve_dtype(dtype_spec, self.files, self.config)
        model = load_decoder(build, self.folder, dtype, self.config, defer=sharded)
        how = "each process reads its FSDP shards" if sharded else "loaded"
        log.info("model.pretrained_from: %s (%s, %d tensors, %.1f MB of weights) %s as %s", self.spec,
                 self.config["model_type"], len(model.state_dict()), self.files.nbytes() / 1e6, how,
                 str(dtype).removeprefix("torch."))
        return model


def generation_defaults(files: TaskFiles, cfg: GenerationConfig, given: Any) -> GenerationConfig:
    """The run's ``generate:`` settings with the model's ``generation_config.json`` where the recipe
    set nothing: its eos ids (several: generation stops at any), pad id and sampling settings."""
    if files.dir is None or not files.exists("generation_config.json"):
        return cfg
    gen = json.loads(files.read_text("generation_config.json"))
    given = set(given or ())
    out = {}
    eos = gen.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if ids and "generate.eos_id" not in given and cfg.eos_id is None:
        out["eos_id"], out["eos_ids"] = ids[0], ids[1:] or None
    pad = gen.get("pad_token_id")
    if "generate.pad_id" not in given and cfg.pad_id is None and (pad is not None or ids):
        out["pad_id"] = pad if isinstance(pad, int) else ids[0]  # pad == eos still ends the text
    if gen.get("do_sample") and "generate.strategy" not in given:
        out["strategy"] = "sample"
    for key, name in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p")):
        if gen.get(key) is not None and f"generate.{name}" not in given:
            out[name] = gen[key]
    return dataclasses.replace(cfg, **out)


def read_hf_json(files: TaskFiles, name: str) -> dict[str, Any]:
    """A kept HF file (``{}`` where the source had none)."""
    return json.loads(files.read_text(name)) if files.dir is not None and files.exists(name) else {}


__all__ = ["HFSource", "HF_CONFIG_FILE", "generation_defaults", "is_hf_source", "read_hf_json", "read_json",
           "resolve_dtype"]
