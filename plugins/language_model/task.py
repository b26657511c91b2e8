"""The ``language_model`` task: a decoder-only Transformer trained on random blocks of a token stream."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tk.core.data.loader import LoaderSpec, build_loader
from tk.core.data.samplers import RandomBlockSampler
from tk.core.distributed import is_main_process
from tk.core.errors import TkError
from tk.core.losses import cross_entropy_sum
from tk.core.media import Text
from tk.core.metrics import Metric
from tk.core.nn.config import TransformerConfig
from tk.core.nn.decoding import GenerationConfig
from tk.core.nn.generation import generate
from tk.core.nn.transformer import DecoderOnlyLM
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.plugins.language_model.corpus import read_corpus, synthetic_text
from tk.plugins.language_model.data import BlockDataset, collate_blocks, split_tokens, token_dtype
from tk.plugins.language_model.hub import iter_texts, load_documents
from tk.plugins.language_model.stream import TextStream
from tk.plugins.language_model.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    load_tokenizer_json,
    read_tokenizer_file,
)

SAMPLES_DIR = "samples"  # in the run dir: step_N.txt, a few generated continuations per evaluation
TOKENIZER_FILE = "tokenizer.json"  # task file: the tokenizer (char vocabulary or a tokenizers JSON)
TOKENS_FILE = "tokens.bin"  # task file: the whole corpus as one token array (uint16 / uint32)
META_FILE = "tokens.json"  # task file: dtype, token and character counts of TOKENS_FILE


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "text", "hub"] = "synthetic"  # synthetic grammar; text: data.path; hub: data.dataset
    path: str | None = None  # source=text: a UTF-8 file, a folder of files or a glob (joined in sorted order)
    dataset: str | None = None  # source=hub: a datasets hub name, or a folder written by save_to_disk
    config: str | None = None  # source=hub: the dataset's configuration name (datasets.load_dataset's name)
    split: str = "train"  # source=hub: the split read (val = its last val_fraction of tokens)
    text_column: str = "text"  # source=hub: the column holding the documents
    doc_separator: str = "\n\n"  # source=hub: text appended to every document before they are joined
    num_sentences: int = 20000  # synthetic: sentences generated (about 25 characters each)
    synthetic_seed: int = 0  # synthetic: seed of the corpus (independent of train.seed)
    tokenizer: Literal["char", "bpe"] = "char"  # char: one id per character (unseen ones -> <unk>); bpe: byte-level BPE
    bpe_vocab_size: int = 4096  # bpe: vocabulary size trained on the train split
    tokenizer_file: str | None = None  # a tokenizers tokenizer.json to use instead of training one
    block_size: int = 64  # context length T in tokens (a training block is T + 1 tokens)
    val_fraction: float = 0.1  # the last fraction of the token stream is the validation split
    eval_blocks: int = 200  # validation blocks per evaluation (sequential, non-overlapping)
    num_samples: int = 3  # continuations written to samples/step_N.txt at each evaluation; 0 = none
    sample_prompt_len: int = 16  # tokens of a val block that each sample continues


@dataclass
class ModelConfig(TransformerConfig):
    """The ``model:`` section: TransformerConfig with GPT defaults."""

    dim: int = 128  # model width D
    dropout: float = 0.0  # residual/embedding dropout
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "learned"  # position information
    max_len: int = 1024  # positions of the learned table: block_size for training, prompt + new tokens in generation


class LMMetrics(Metric):
    """Bits per token, perplexity (= exp(nats per token)) and, for char level, bits per char;
    with ``bytes_per_token`` (BPE), bits per UTF-8 byte of the evaluated text."""

    def __init__(self, per_char: bool, bytes_per_token: float | None = None,
                 samples: Callable[[EvalContext], str | None] | None = None) -> None:
        super().__init__()
        self.per_char, self.bytes_per_token = per_char, bytes_per_token
        self._samples = samples  # the evaluation's generated samples, for the loggers
        self.add_state("nats", torch.zeros((), dtype=torch.float64))
        self.add_state("count", torch.zeros((), dtype=torch.float64))

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        self.nats += out.loss.detach().to(self.nats.device, torch.float64)
        self.count += torch.as_tensor(out.num_items).to(self.count.device, torch.float64)

    def keys(self) -> list[str]:
        return (["bits_per_token", "perplexity"] + (["bits_per_char"] if self.per_char else [])
                + (["bits_per_byte"] if self.bytes_per_token else []))

    def compute(self) -> dict[str, float]:
        nats = float(self.nats) / max(float(self.count), 1.0)
        out = {"bits_per_token": nats / math.log(2), "perplexity": math.exp(nats)}
        if self.per_char:  # one token is one character
            out["bits_per_char"] = out["bits_per_token"]
        if self.bytes_per_token:
            out["bits_per_byte"] = out["bits_per_token"] / self.bytes_per_token
        return out

    def media(self, ctx: EvalContext) -> list[Text]:
        """This evaluation's samples (also in ``samples/step_N.txt``) as one text item."""
        text = self._samples(ctx) if self._samples is not None else None
        return [Text(f"{ctx.key_prefix}/samples", text)] if text else []


def gpt2_init(model: DecoderOnlyLM, depth: int) -> None:
    """GPT-2's extra step over DecoderOnlyLM's N(0, 0.02): residual output projections get
    std 0.02 / sqrt(2 * layers), so the residual stream's variance does not grow with depth."""
    for name, p in model.named_parameters():
        if name.endswith(("self_attn.proj.weight", "mlp.fc2.weight")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth))


class LanguageModelTask(Task):
    """Decoder-only language model (GPT) on a text corpus or a built-in synthetic grammar."""

    name: ClassVar[str] = "language_model"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"generate": GenerationConfig}

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.gen_cfg: GenerationConfig = self.sections.get("generate") or GenerationConfig()
        self.tokenizer: CharTokenizer | BPETokenizer | None = None
        self.splits: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = {}
        self._sampled: set[tuple] = set()  # evaluations that already wrote their samples
        self._sample_text: dict[tuple, str] = {}  # their text, handed to the loggers as media
        self._bytes_per_token: float | None = None  # of the eval targets (bits per byte), computed once

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        d: DataConfig = cfg.sections["data"]
        m: ModelConfig = cfg.sections["model"]
        problems = []  # the model: and generate: sections run their own check()
        if d.source == "hub" and not d.dataset:
            problems.append("data.dataset: source=hub needs a datasets name (or a save_to_disk folder)")
        if d.source == "text" and not d.path:
            problems.append("data.path: source=text needs a text file, folder or glob (or set data.source=synthetic)")
        if d.block_size < 1:
            problems.append(f"data.block_size ({d.block_size}) must be >= 1")
        if m.pos_encoding == "learned" and d.block_size > m.max_len:
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
        if d.bpe_vocab_size < 257:
            problems.append(f"data.bpe_vocab_size ({d.bpe_vocab_size}) must be >= 257 (256 byte symbols + merges)")
        return problems

    # -- set-up: tokenise once, reload afterwards ------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Tokenise the corpus once into the task files ``tokens.bin`` (+ ``tokens.json``) and
        ``tokenizer.json``; a resumed, evaluated or generating run reads them (never retrains)."""
        if self.run_dir is not None and self.files.exists(META_FILE):
            self.tokenizer = load_tokenizer_json(self.files.read_text(TOKENIZER_FILE))
            self.meta = json.loads(self.files.read_text(META_FILE))
            tokens = np.memmap(self.files.path(TOKENS_FILE), dtype=self.meta["dtype"], mode="r")
        else:
            if resume:
                raise TkError(f"the run has no task file {META_FILE} in {self.files.path(META_FILE).parent}; "
                              f"it was not written by this task (start a fresh run)")
            tokens = self._tokenise()
        self.splits = split_tokens(tokens, self.data.val_fraction, self.data.block_size)

    def _read_text(self) -> str:
        d = self.data
        if d.source == "synthetic":
            return synthetic_text(d.num_sentences, d.synthetic_seed)
        return read_corpus(d.path)

    def _empty_corpus(self) -> TkError:
        d = self.data
        return TkError(f"data: the corpus ({d.path or d.dataset or 'synthetic'}) is empty (0 tokens); the run needs "
                       f"at least data.block_size + 1 = {d.block_size + 1} tokens in each split")

    def _tokenise(self) -> np.ndarray:
        d = self.data
        if d.source == "hub":
            return self._tokenise_documents()
        text = self._read_text()
        if not text:
            raise self._empty_corpus()
        train_text = text[: len(text) - int(len(text) * d.val_fraction)]  # the tokenizer never sees val
        self.tokenizer = read_tokenizer_file(d.tokenizer_file) if d.tokenizer_file else self._train_tokenizer([train_text])
        dtype = token_dtype(self.tokenizer.vocab_size)
        tokens = np.asarray(self.tokenizer.encode(text), dtype=dtype)
        self._save(tokens, len(text))
        return tokens

    def _tokenise_documents(self) -> np.ndarray:
        """A hub corpus, streamed: the tokenizer (given, or trained on the documents before
        the validation cut) and then the documents in batches, each followed by
        ``data.doc_separator``, appended to the token file. The text never has to fit in
        memory (only the uint16/32 tokens are then memory-mapped)."""
        d = self.data
        ds = load_documents(d.dataset, d.config, d.split, d.text_column)
        if d.tokenizer_file:
            self.tokenizer = read_tokenizer_file(d.tokenizer_file)
        else:
            self.tokenizer = self._train_tokenizer(self._train_documents(ds))
        dtype = token_dtype(self.tokenizer.vocab_size)
        chunks, num_chars, num_tokens = [], 0, 0
        out = None
        if self.run_dir is not None:
            part = self.files.path(TOKENS_FILE).with_suffix(".part")
            part.parent.mkdir(parents=True, exist_ok=True)
            out = open(part, "wb")  # noqa: SIM115 (closed in the finally below)
        try:
            for texts in iter_texts(ds, d.text_column):
                texts = [t + d.doc_separator for t in texts]
                ids = np.concatenate([np.asarray(e, dtype=dtype) for e in self.tokenizer.encode_batch(texts)])
                num_chars += sum(map(len, texts))
                num_tokens += len(ids)
                chunks.append(ids) if out is None else out.write(ids.tobytes())
            if num_tokens == 0:
                raise self._empty_corpus()
        except BaseException:  # an error or Ctrl-C: no half-written token file is left in the task files
            if out is not None:
                out.close()
                Path(out.name).unlink(missing_ok=True)
            raise
        if out is not None:
            out.close()
        if out is None:
            tokens = np.concatenate(chunks)
        else:
            Path(out.name).replace(self.files.path(TOKENS_FILE))
            tokens = np.memmap(self.files.path(TOKENS_FILE), dtype=dtype, mode="r")
        self._save(tokens, num_chars, write_tokens=False)
        return tokens

    def _train_tokenizer(self, texts: Iterable[str]) -> CharTokenizer | BPETokenizer:
        """``data.tokenizer`` trained on a stream of training texts."""
        if self.data.tokenizer == "bpe":
            return BPETokenizer.train_from_texts(texts, self.data.bpe_vocab_size)
        return CharTokenizer.train_from_texts(texts)

    def _train_documents(self, ds: Any) -> Iterator[str]:
        """The documents (each with its separator) up to the character where the validation
        part starts, the last one cut there: what the tokenizer may see. Counting the
        characters first is one more pass over the column, not a copy of it."""
        d = self.data
        sep = d.doc_separator
        total = sum(len(t) + len(sep) for texts in iter_texts(ds, d.text_column) for t in texts)
        left = total - int(total * d.val_fraction)
        for texts in iter_texts(ds, d.text_column):
            for t in texts:
                if left <= 0:
                    return
                doc = (t + sep)[:left]
                left -= len(doc)
                yield doc

    def _save(self, tokens: np.ndarray, num_chars: int, write_tokens: bool = True) -> None:
        dtype = np.dtype(tokens.dtype)
        self.meta = {"dtype": dtype.name, "num_tokens": len(tokens), "num_chars": num_chars,
                     "vocab_size": self.tokenizer.vocab_size, "kind": self.tokenizer.kind}
        if self.run_dir is not None:  # tk summary has no run dir: keep everything in memory
            self.files.write_text(TOKENIZER_FILE, self.tokenizer.to_json())
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
        """Training: random blocks, batch k a pure function of (seed, rank, k) (exact resume)."""
        ds = self.build_dataset(split)
        if split != "train":
            return build_loader(ds, spec, self.collate)
        sampler = RandomBlockSampler.from_spec(spec, len(self.splits["train"]), self.data.block_size + 1)
        return build_loader(ds, spec, self.collate, batch_sampler=sampler)

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = DecoderOnlyLM(self.model_cfg, self.vocab_size)
        gpt2_init(model, self.model_cfg.depth)
        return model

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
            self._bytes_per_token = len(self.tokenizer.decode(targets).encode("utf-8")) / max(len(targets), 1)
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
        limit = self.data.block_size  # the longest context the model was trained on
        if len(ids) + cfg.max_len > limit:
            raise TkError(f"prompt ({len(ids)} tokens) + new tokens ({cfg.max_len}, --max-new-tokens or "
                          f"generate.max_len) exceeds data.block_size ({limit}), the context the model was "
                          f"trained on; shorten the prompt or ask for fewer new tokens")
        device = next(model.parameters()).device
        stream = None if on_text is None else TextStream(self.tokenizer.decode, on_text, cfg.eos_id)
        out = generate(model, torch.tensor([ids], device=device), cfg, on_step=stream)
        text = self.tokenizer.decode(out.tokens[0].tolist())
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
            self._sample_text = {key: self._write_samples(model, batch["tokens"], ctx)}  # only the latest is kept
        return self.loss(model, batch)

    def _write_samples(self, model: nn.Module, tokens: torch.Tensor, ctx: EvalContext) -> str:
        n = min(self.data.num_samples, tokens.shape[0])
        prompt_len = min(self.data.sample_prompt_len, self.data.block_size - 1)
        cfg = dataclasses.replace(self.gen_cfg, max_len=min(self.gen_cfg.max_len, self.data.block_size - prompt_len))
        out = generate(model, tokens[:n, :prompt_len], cfg)
        parts = []
        for i in range(n):
            prompt = self.tokenizer.decode(tokens[i, :prompt_len].tolist())
            parts.append(f"--- sample {i}: prompt {prompt!r}\n{prompt}{self.tokenizer.decode(out.tokens[i].tolist())}\n")
        suffix = "" if ctx.key_prefix == "val" else f"_{ctx.key_prefix}"
        path = Path(self.run_dir) / SAMPLES_DIR / f"step_{ctx.step}{suffix}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(parts), encoding="utf-8")
        return "".join(parts)

    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """``{"input": prompt, "generated": text}`` per prompt (``generate:`` settings)."""
        return [{"input": p, "generated": self.continue_text(model, p)} for p in inputs]
