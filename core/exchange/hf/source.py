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
from tk.core.exchange.hf.decoders import decoder_config, family_of, load_decoder, resolve_dtype
from tk.core.exchange.hf.folder import TOKENIZER_FILES, WeightFiles, is_hf_folder, read_config, read_json
from tk.core.exchange.hf.peft import adapter_lora, linear_names, load_adapter, read_adapter
from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation import GenerationConfig
from tk.core.nn.lm import DecoderOnlyLM
from tk.core.nn.lora import LoRAConfig
from tk.core.text import TextTokenizer

HF_CONFIG_FILE = "hf_config.json"  # task file: the source's config.json (what export writes back)
ADAPTER_FILE = "peft_adapter_config.json"  # task file: the adapter_config.json of model.adapter_from
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

    def family_names(self, model_cfg: Any) -> dict[str, tuple[str, int, int]]:
        """The family's Linear names of the model ``model_cfg`` describes (built on the meta device)."""
        cfg = TransformerConfig.of(model_cfg)
        with torch.device("meta"):
            return linear_names(family_of(self.config), DecoderOnlyLM(cfg, self.vocab_size), cfg)

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


# -- LoRA by the family's names, PEFT adapters in -----------------------------------------
def hf_lora_names(files: TaskFiles, model: torch.nn.Module, model_cfg: Any) -> dict[str, tuple[str, int, int]]:
    """The source family's Linear names of a run from a Hugging Face decoder (``{}`` for another run)."""
    config = read_hf_json(files, HF_CONFIG_FILE)
    if not config or not isinstance(model, DecoderOnlyLM):
        return {}
    return linear_names(family_of(config), model, TransformerConfig.of(model_cfg))


def adapter_section(files: TaskFiles, spec: str, model_cfg: Any, vocab_size: int) -> LoRAConfig:
    """The ``model.lora`` of a run starting from the PEFT adapter ``spec`` (its config kept as a
    task file, so that resume, eval and export need the folder no more).

    Raises:
        TkError: an unreadable adapter or one tk cannot express (:func:`read_adapter`).
    """
    if files.dir is not None and files.exists(ADAPTER_FILE):
        config = json.loads(files.read_text(ADAPTER_FILE))
    else:
        config = read_adapter(spec)
        if files.dir is not None:
            files.write_text(ADAPTER_FILE, json.dumps(config, indent=1))
    cfg = TransformerConfig.of(model_cfg)
    family = family_of(read_hf_json(files, HF_CONFIG_FILE))
    with torch.device("meta"):
        names = linear_names(family, DecoderOnlyLM(cfg, vocab_size), cfg)
    return adapter_lora(config, names, family, cfg)


def init_adapter(files: TaskFiles, model: torch.nn.Module, model_cfg: Any, spec: str) -> None:
    """Copy the PEFT adapter ``spec`` into the LoRA layers of a fresh run's ``model``.

    Raises:
        TkError: tensors of another shape, missing or left over (another model's adapter).
    """
    config = json.loads(files.read_text(ADAPTER_FILE)) if files.exists(ADAPTER_FILE) else read_adapter(spec)
    base = config.get("base_model_name_or_path")
    source = json.loads(files.read_text(RECORD_FILE)).get("from") if files.exists(RECORD_FILE) else None
    hf = read_hf_json(files, HF_CONFIG_FILE)
    n = load_adapter(model, hf_lora_names(files, model, model_cfg), family_of(hf), TransformerConfig.of(model_cfg),
                     spec, base)
    log.info("model.adapter_from: %s (%d tensors, r=%s, lora_alpha=%s) loaded into the LoRA layers%s", spec, n,
             config.get("r"), config.get("lora_alpha"),
             "" if base in (None, source) or Path(str(base)).name == Path(str(source)).name
             else f"; it names base model {base!r} and this run starts from {source!r}: its shapes fit")


def read_hf_json(files: TaskFiles, name: str) -> dict[str, Any]:
    """A kept HF file (``{}`` where the source had none)."""
    return json.loads(files.read_text(name)) if files.dir is not None and files.exists(name) else {}


__all__ = ["HFSource", "HF_CONFIG_FILE", "ADAPTER_FILE", "generation_defaults", "is_hf_source", "read_hf_json",
           "read_json", "resolve_dtype", "hf_lora_names", "adapter_section", "init_adapter"]
