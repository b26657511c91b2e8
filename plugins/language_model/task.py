"""The ``language_model`` task: a decoder-only Transformer trained on random blocks of a token stream."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tk.core.data.loader import LoaderSpec, build_loader
from tk.core.data.samplers import RandomBlockSampler
from tk.core.distributed import get_world_size, is_main_process
from tk.core.engine.inference import (
    TRANSFORMER_SHAPE_KEYS,
    SourceRun,
    adopt_shape,
    describe_shape,
    load_backbone,
    open_source,
    read_record,
    what_is,
    write_record,
)
from tk.core.errors import TkError
from tk.core.exchange.hf.source import HFSource, generation_defaults, hf_lora_names, is_hf_source, resolve_dtype
from tk.core.losses import cross_entropy_sum
from tk.core.metrics import Metric
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.core.text import TextTokenizer, build_tokenizer, cut_pieces, encode_long, iter_column, load_hub_dataset
from tk.core.text.long_text import adds_specials
from tk.core.text.stream import TextStream
from tk.core.text.token_store import TokenStore
from tk.plugins.language_model.corpus import corpus_files, iter_corpus, synthetic_text, take_chars
from tk.plugins.language_model.data import (
    UNK,
    BlockDataset,
    DataConfig,
    TokenizerConfig,
    collate_blocks,
    corpus_identity,
    decode,
    decode_after,
    empty_corpus,
    load_saved_tokenizer,
    split_tokens,
    token_dtype,
    tokenise_documents,
    tokenise_pieces,
    train_documents,
)
from tk.plugins.language_model.metrics import LMMetrics
from tk.plugins.language_model.model import ModelConfig, build_model
from tk.plugins.language_model.samples import SAMPLES_DIR, write_samples  # noqa: F401  (SAMPLES_DIR: kept importable here)

TOKENIZER_FILE = "tokenizer.json"  # task file: the tokenizer (a tokenizers JSON)
TOKENS_FILE = "tokens.bin"  # task file: the whole corpus as one token array (uint16 / uint32)
META_FILE = "tokens.json"  # task file: dtype, token and character counts of TOKENS_FILE

log = logging.getLogger(__name__)


class LanguageModelTask(Task):
    """Decoder-only language model (GPT) on a text corpus or a built-in synthetic grammar."""

    name: ClassVar[str] = "language_model"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"tokenizer": TokenizerConfig, "generate": GenerationConfig}
    renamed_keys: ClassVar[Mapping[str, str]] = {
        "data.tokenizer": "tokenizer.kind", "data.bpe_vocab_size": "tokenizer.vocab_size",
        "data.tokenizer_file": "tokenizer.path", "data.dataset": "data.hf_name", "data.config": "data.hf_config",
        "data.split": "data.hf_split", "data.synthetic_seed": "data.seed", "data.source=hub": "data.source=hf",
    }

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.gen_cfg: GenerationConfig = self.sections.get("generate") or GenerationConfig()
        self.tok_cfg: TokenizerConfig = self.sections.get("tokenizer") or TokenizerConfig()
        self.tokenizer: TextTokenizer | None = None
        self.splits: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = {}
        self._sampled: set[tuple] = set()  # evaluations that already wrote their samples
        self._sample_text: dict[tuple, str] = {}  # their text, handed to the loggers as media
        self._bytes_per_token: float | None = None  # of the eval targets (bits per byte), computed once
        self.source: SourceRun | None = None  # model.pretrained_from's run (a fresh run only)
        self.hf: HFSource | None = None  # model.pretrained_from's Hugging Face folder (a fresh run only)

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        d: DataConfig = cfg.sections["data"]
        m: ModelConfig = cfg.sections["model"]
        problems = []  # the model: and generate: sections run their own check()
        if d.source == "hf" and not d.hf_name:
            problems.append("data.hf_name: source=hf needs a datasets name (or a save_to_disk folder)")
        if d.source == "text" and not d.path:
            problems.append("data.path: source=text needs a text file, folder or glob (or set data.source=synthetic)")
        if d.block_size < 1:
            problems.append(f"data.block_size ({d.block_size}) must be >= 1")
        if m.pos_encoding == "learned" and d.block_size > m.max_len and not is_hf_source(m.pretrained_from):
            problems.append(f"data.block_size ({d.block_size}) exceeds model.max_len ({m.max_len}); raise model.max_len")
        if not 0.0 < d.val_fraction < 1.0:
            problems.append(f"data.val_fraction ({d.val_fraction}) must be in (0, 1)")
        if d.eval_blocks < 1:
            problems.append(f"data.eval_blocks ({d.eval_blocks}) must be >= 1")
        if d.num_samples < 0 or d.sample_prompt_len < 1:
            problems.append(f"data.num_samples ({d.num_samples}) must be >= 0 and data.sample_prompt_len "
                            f"({d.sample_prompt_len}) >= 1")
        if d.num_sentences < 1:
            problems.append(f"data.num_sentences ({d.num_sentences}) must be >= 1")
        return problems

    @classmethod
    def check_fresh_run(cls, cfg: Any) -> list[str]:
        """A ``model.pretrained_from`` run: readable, a language_model run, with its tokenizer
        file and the shape and tokenizer the recipe asks for."""
        task = cls(cfg)
        try:
            task._open_source(write=False)
            if task.hf is not None:
                task.hf.tokenizer()
            if task.source is not None:
                task.source.weights()
                task.source.read_file(TOKENIZER_FILE)
        except TkError as e:
            return [str(e)]
        return []

    # -- set-up: tokenise once, reload afterwards ------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Tokenise the corpus once into the task files ``tokens.bin`` (+ ``tokens.json``) and
        ``tokenizer.json``; a resumed, evaluated or generating run reads them (never retrains).
        With ``model.pretrained_from`` (a fresh run) the source run's tokenizer and shape are used."""
        record = read_record(self.files)
        if not resume and self.model_cfg.pretrained_from is not None:  # every rank: each loads the weights
            self._open_source()
        elif record is not None:  # a run started from another: the shape it adopted then
            self.model_cfg = dataclasses.replace(self.model_cfg, **record["model"])
        if self.hf is not None or str((record or {}).get("task", "")).startswith("hf:"):
            self.gen_cfg = generation_defaults(self.files, self.gen_cfg, self.cfg.given)
        if self.run_dir is not None and self.files.exists(META_FILE):
            self.tokenizer = load_saved_tokenizer(self.files.read_text(TOKENIZER_FILE))
            self.meta = json.loads(self.files.read_text(META_FILE))
            tokens = np.memmap(self.files.path(TOKENS_FILE), dtype=self.meta["dtype"], mode="r")
        else:
            if resume:
                raise TkError(f"the run has no task file {META_FILE} in {self.files.path(META_FILE).parent}; "
                              f"it was not written by this task (start a fresh run)")
            tokens = self._tokenise()
        self.splits = split_tokens(tokens, self.data.val_fraction, self.data.block_size)

    def _open_source(self, write: bool = True) -> None:
        """The source run of ``model.pretrained_from``: its shape (recipe keys must agree) and its
        tokenizer (a recipe asking for another one is refused), before anything is tokenised."""
        if self.model_cfg.pretrained_from is None:
            return
        if is_hf_source(self.model_cfg.pretrained_from):
            return self._open_hf(write)
        source = open_source(self.model_cfg.pretrained_from, self.name, (self.name,))
        if source is None:
            raise TkError(f"model.pretrained_from: {what_is(self.model_cfg.pretrained_from)}neither a tk run dir (a folder "
                          f"with config.yaml) nor a .pt checkpoint; give the output_dir of a language_model run")
        theirs = source.section("tokenizer").get("kind")
        if self.tok_cfg.path is not None:
            raise TkError(f"tokenizer.path: model.pretrained_from brings the source run's tokenizer; remove "
                          f"tokenizer.path ({self.tok_cfg.path})")
        if theirs is not None and self.tok_cfg.kind != theirs and self.tok_cfg.kind != TokenizerConfig().kind:
            raise TkError(f"tokenizer.kind: the recipe asks for {self.tok_cfg.kind!r} but the model.pretrained_from "
                          f"run uses {theirs!r} (its tokenizer comes with it); remove tokenizer.kind or set it to "
                          f"{theirs!r}")
        self.model_cfg = adopt_shape(self.model_cfg, source.section("model"), TRANSFORMER_SHAPE_KEYS,
                                     self.cfg.given)
        m = self.model_cfg
        if m.pos_encoding == "learned" and self.data.block_size > m.max_len:
            raise TkError(f"data.block_size ({self.data.block_size}) exceeds the model.pretrained_from run's "
                          f"model.max_len ({m.max_len}); lower data.block_size")
        self.source = source
        if write:
            write_record(self.files, source, {k: getattr(m, k) for k in TRANSFORMER_SHAPE_KEYS})

    def _open_hf(self, write: bool) -> None:
        """A Hugging Face decoder: its shape (recipe keys must agree) and its tokenizer."""
        if self.tok_cfg.path is not None:
            raise TkError(f"tokenizer.path: model.pretrained_from brings the model's own tokenizer; remove "
                          f"tokenizer.path ({self.tok_cfg.path})")
        self.hf = HFSource.open(self.model_cfg.pretrained_from)
        self.model_cfg = self.hf.adopt(self.model_cfg, self.cfg.given, self.data.block_size)
        if write:
            # the dtype as resolved (auto: the file's), so resume, eval and export rebuild it
            dtype = str(resolve_dtype(self.model_cfg.dtype, self.hf.files, self.hf.config)).removeprefix("torch.")
            self.hf.keep_files(self.files, {**{k: getattr(self.model_cfg, k) for k in TRANSFORMER_SHAPE_KEYS},
                                            "dtype": dtype})

    def _tokenise(self) -> np.ndarray:
        """The tokenizer (given, or trained on the part before the validation cut) and the
        corpus's tokens, saved as task files."""
        d = self.data
        if d.source == "hf":  # streamed: the text never has to fit in memory
            ds = load_hub_dataset(d.hf_name, d.hf_config, d.hf_split, streaming=d.streaming,
                                  columns={d.text_column: "data.text_column"}, local="data.source: text with data.path")
            self.tokenizer = self._source_tokenizer() or build_tokenizer(self.tok_cfg, train_documents(ds, d))
            path = None if self.run_dir is None else self.files.path(TOKENS_FILE)
            if d.token_cache:  # built once per corpus and tokenizer, continued after a kill
                store = TokenStore(self.tokenizer, corpus_identity(ds, d), d.doc_separator,
                                   token_dtype(self.tokenizer.vocab_size))
                tokens, num_chars, _ = store.build(iter_column(ds, d.text_column))
                if path is not None:
                    store.link_into(path)
                    tokens = np.memmap(path, dtype=tokens.dtype, mode="r")
            else:
                tokens, num_chars = tokenise_documents(ds, self.tokenizer, d, path)
            self._save(tokens, num_chars, write_tokens=False)
            return tokens
        if d.source == "text":
            return self._tokenise_files(corpus_files(d.path))
        text = synthetic_text(d.num_sentences, d.seed)
        if not text:
            raise empty_corpus(d)
        self.tokenizer = self._source_tokenizer() or build_tokenizer(
            self.tok_cfg, [text[: len(text) - int(len(text) * d.val_fraction)]])
        tokens = np.asarray(encode_long(self.tokenizer, text), dtype=token_dtype(self.tokenizer.vocab_size))
        self._save(tokens, len(text))
        return tokens

    def _tokenise_files(self, files: list[Path]) -> np.ndarray:
        """``data.path`` read in chunks, three times (count, train on the part before the
        validation cut, tokenise into the task file): a corpus larger than memory is never held,
        and the tokenizer and tokens equal those of the whole text (``cut_pieces``)."""
        d = self.data
        num_chars = sum(map(len, iter_corpus(files)))
        if num_chars == 0:
            raise empty_corpus(d)
        self.tokenizer = self._source_tokenizer() or build_tokenizer(
            self.tok_cfg, cut_pieces(take_chars(iter_corpus(files), num_chars - int(num_chars * d.val_fraction))))
        if adds_specials(self.tokenizer):  # a template frames the corpus once, as one text
            tokens = np.asarray(self.tokenizer.encode("".join(iter_corpus(files))), token_dtype(self.tokenizer.vocab_size))
            self._save(tokens, num_chars)
            return tokens
        pieces = cut_pieces(iter_corpus(files), anywhere=self.tokenizer.kind == "char")
        tokens, _ = tokenise_pieces(pieces, self.tokenizer, None if self.run_dir is None else self.files.path(TOKENS_FILE))
        if len(tokens) == 0:
            raise empty_corpus(d)
        self._save(tokens, num_chars, write_tokens=False)
        return tokens

    def _source_tokenizer(self) -> TextTokenizer | None:
        """The source run's tokenizer (None without ``model.pretrained_from``)."""
        if self.hf is not None:
            return self.hf.tokenizer()
        if self.source is None:
            return None
        self.source.copy_files(self.files, [TOKENIZER_FILE])  # byte for byte, before _save keeps it
        return load_saved_tokenizer(self.source.read_file(TOKENIZER_FILE))

    def _save(self, tokens: np.ndarray, num_chars: int, write_tokens: bool = True) -> None:
        dtype = np.dtype(tokens.dtype)
        self.meta = {"dtype": dtype.name, "num_tokens": len(tokens), "num_chars": num_chars,
                     "vocab_size": self.tokenizer.vocab_size if self.hf is None else self.hf.vocab_size,
                     "kind": self.tokenizer.kind}
        if self.run_dir is not None:  # tk summary has no run dir: keep everything in memory
            if not self.files.exists(TOKENIZER_FILE):  # the source run's copy is kept as it is
                self.files.write_text(TOKENIZER_FILE, self.tokenizer.to_str())
            if write_tokens:
                self.files.write_bytes(TOKENS_FILE, tokens.tobytes())
            self.files.write_text(META_FILE, json.dumps(self.meta, indent=1))

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    # -- data ------------------------------------------------------------------------
    def build_dataset(self, split: str) -> Dataset:
        """Train: every block start (``RandomBlockSampler`` draws them); val/test: the first
        ``data.eval_blocks`` sequential blocks of the validation tokens."""
        if split == "train":
            return BlockDataset(self.splits["train"], self.data.block_size)
        return BlockDataset(self.splits["val"], self.data.block_size, self.data.block_size, self.data.eval_blocks)

    def collate(self, samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return collate_blocks(samples)

    def build_loader(self, split: str, spec: LoaderSpec) -> DataLoader:
        """Training: random blocks, the job's batch k a pure function of (seed, k), this process
        taking its slice (exact resume; N processes train as one with the global batch)."""
        ds = self.build_dataset(split)
        if split != "train":
            return build_loader(ds, spec, self.collate)
        sampler = RandomBlockSampler.from_spec(spec, len(self.splits["train"]), self.data.block_size + 1)
        return build_loader(ds, spec, self.collate, batch_sampler=sampler)

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The GPT; with a Hugging Face source (a fresh run) its weights, loaded on the meta device."""
        if self.hf is not None:  # under FSDP (no adapters to initialise) each process loads only its shards
            sharded = self.cfg.train.strategy == "fsdp" and get_world_size() > 1 and self.model_cfg.lora is None
            return self.hf.build(lambda: build_model(self.model_cfg, self.vocab_size), self.model_cfg.dtype, sharded)
        model = build_model(self.model_cfg, self.vocab_size)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.model_cfg.dtype)
        return model.to(dtype) if dtype is not None else model  # resume: the dtype the run trained in

    def example_inputs(self, model: nn.Module) -> dict[str, Any]:
        """``tk export``: two random token sequences of 8 ids."""
        return {"tokens": torch.randint(0, self.vocab_size, (2, 8))}

    def lora_names(self, model: nn.Module) -> dict[str, tuple[str, int, int]]:  # a HF source's own layer names
        return hf_lora_names(self.files, model, self.model_cfg)

    def init_pretrained(self, model: nn.Module) -> None:
        """``model.pretrained_from``: every weight of the source run's model (continued training)."""
        if self.source is not None:
            loaded = load_backbone(model, self.source.weights())
            log.info("model.pretrained_from: all %d tensors from %s (%s run, %s); shape: %s", len(loaded),
                     self.source.spec, self.source.task, self.source.checkpoint.name, describe_shape(self.model_cfg))
            self.source = None  # done: drop the mapped checkpoint

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Next-token cross-entropy in nats, summed over the batch's tokens."""
        logits = model(batch["tokens"])  # (B, T, V)
        loss, count = cross_entropy_sum(logits, batch["targets"])
        return StepOutput(loss=loss, num_items=count)

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        char = self.meta.get("kind") == "char"
        return {"lm": LMMetrics(per_char=char, bytes_per_token=None if char else self._eval_bytes_per_token(),
                                samples=lambda c: self._sample_text.get((c.step, c.kind, c.index, c.key_prefix)))}

    def _eval_bytes_per_token(self) -> float | None:
        """UTF-8 bytes per token of the evaluated targets (the val tokens the eval blocks predict);
        None before ``setup``."""
        if self._bytes_per_token is None and "val" in self.splits:
            n = len(self.build_dataset("val")) * self.data.block_size
            targets = self.splits["val"][1: n + 1].tolist()
            self._bytes_per_token = len(decode(self.tokenizer, targets).encode("utf-8")) / max(len(targets), 1)
        return self._bytes_per_token

    # -- inference ---------------------------------------------------------------------
    @torch.no_grad()
    def continue_text(
        self, model: nn.Module, prompt: str, cfg: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """The text ``model`` generates after ``prompt`` under ``cfg`` (default ``generate:``).

        ``on_text`` (streaming) gets each new piece of text as soon as its token is generated
        (for BPE, a piece that ends inside a multi-byte character waits for the next token);
        the pieces add up to the returned text.

        Raises:
            TkError: an empty prompt, or prompt + new tokens beyond ``data.block_size`` (the KV cache
                does not slide, and positions past the training context are untrained).
        """
        cfg = cfg or self.gen_cfg
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise TkError("--prompt: the prompt is empty; give at least one character")
        if self.tokenizer.kind == "char":  # an unseen character would silently become <unk>
            unseen = sorted({c for c in prompt if self.tokenizer.tok.token_to_id(c) is None})
            if unseen:
                raise TkError(f"the prompt has characters the model never saw ({''.join(unseen)!r}: they would all be "
                              f"{UNK}); use the characters of its training text")
        # the longest context: what the model was trained on (a pretrained decoder: its positions)
        pretrained = self.files.dir is not None and self.files.exists("hf_config.json")
        limit, what = (self.model_cfg.max_len, "model.max_len") if pretrained else (self.data.block_size, "data.block_size")
        if len(ids) + cfg.max_len > limit:
            raise TkError(f"prompt ({len(ids)} tokens) + new tokens ({cfg.max_len}, --max-new-tokens or "
                          f"generate.max_len) exceeds {what} ({limit}), the context of the model; shorten the "
                          f"prompt or ask for fewer new tokens")
        device = next(model.parameters()).device
        after = partial(decode_after, self.tokenizer, ids)  # the text after the prompt, its seam included
        stream = None if on_text is None else TextStream(after, on_text, cfg.stop_ids)
        out = generate(model, torch.tensor([ids], device=device), cfg, on_step=stream)
        text = after(out.tokens[0])
        if stream is not None:
            stream.finish(text)
        return text

    # -- samples at each evaluation ------------------------------------------------------
    def eval_step(self, model: nn.Module, batch: dict[str, Any], ctx: EvalContext) -> StepOutput:
        """The loss; on the first batch of each evaluation during training, also a few samples
        (``data.num_samples`` continuations of the first ``data.sample_prompt_len`` tokens of
        val blocks, ``generate:`` settings) written to ``samples/step_N.txt`` in the run dir."""
        key = (ctx.step, ctx.kind, ctx.index, ctx.key_prefix)
        if (self.data.num_samples and self.run_dir is not None and ctx.kind != "standalone"  # training only
                and key not in self._sampled and is_main_process()):
            self._sampled.add(key)
            self._sample_text = {key: write_samples(self, model, batch["tokens"], ctx)}  # only the latest is kept
        return self.loss(model, batch)

    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """``{"input": prompt, "generated": text}`` per prompt (``generate:`` settings)."""
        return [{"input": p, "generated": self.continue_text(model, p)} for p in inputs]
