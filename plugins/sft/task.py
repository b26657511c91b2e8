"""The ``sft`` task: supervised fine-tuning of a decoder on instructions and conversations, rendered
with the model's own chat template, the loss on the assistant's tokens only (by default), divided by
the number of those tokens (exact under accumulation and several processes)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from tk.core.distributed import get_world_size, is_main_process
from tk.core.engine.inference import read_record
from tk.core.errors import TkError
from tk.core.exchange.hf.peft import read_adapter
from tk.core.exchange.hf.source import (HFSource, adapter_section, generation_defaults, hf_lora_names, init_adapter,
                                        is_hf_source, resolve_dtype)
from tk.core.exchange.pretrained import TRANSFORMER_SHAPE_KEYS
from tk.core.losses import cross_entropy_sum
from tk.core.metrics import Metric
from tk.core.nn.config import ENCODER_DECODER_KEYS, TransformerConfig
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.nn.lm import DecoderOnlyLM
from tk.core.nn.lora import apply_lora
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.core.text import TextTokenizer, build_tokenizer, load_hub_dataset
from tk.core.text import TokenizerConfig as SharedTokenizerConfig
from tk.core.text.chat import DEFAULT_TEMPLATE, TEMPLATE_FILE, ChatTemplate, encode_chat, read_chat_template
from tk.core.text.stream import TextStream
from tk.plugins.sft.data import (
    IGNORE,
    Counts,
    DataConfig,
    ExampleDataset,
    check_data,
    collate_examples,
    detect_format,
    make_example,
    pack_splits,
    read_rows,
    renamed,
    synthetic_rows,
    to_messages,
)
from tk.plugins.sft.metrics import SFTMetrics

log = logging.getLogger(__name__)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # a new model's specials: pad, turn start/end
META_FILE = "sft.json"  # task file: vocab size, pad id and the end-of-turn ids
OPEN_ENDED = (("prompt", "completion"), ("instruction", "output"))  # a row to answer may leave its answer out


@dataclass
class ModelConfig(TransformerConfig):
    """The ``model:`` section: a pretrained decoder (``pretrained_from``) or a new small one."""

    unused_keys: ClassVar[tuple[str, ...]] = ENCODER_DECODER_KEYS  # one stack: no encoder-decoder keys

    dim: int = 128  # model width D (a new model)
    depth: int = 4  # layers (a new model)
    activation: Literal["gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu", "geglu_tanh"] = "swiglu"  # feed-forward activation
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"  # normalisation layer kind
    bias: bool = False  # biases in the linear layers
    dropout: float = 0.0  # residual/embedding dropout
    pos_encoding: Literal["sinusoidal", "learned", "rotary", "none"] = "rotary"  # position information
    max_len: int = 1024  # positions of the model (a new model)
    pretrained_from: str | None = None  # a Hugging Face decoder folder or hub id (its shape, tokenizer and chat template); null: a new model, tk's tokenizer and ChatML
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # weights of a pretrained source: float32 masters, or the file's bf16 kept (with LoRA)
    adapter_from: str | None = None  # a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) for the pretrained_from model: training continues from it (or evaluate it); it sets model.lora


@dataclass
class TokenizerConfig(SharedTokenizerConfig):
    """The ``tokenizer:`` section (a new model only: a pretrained one brings its own)."""

    vocab_size: int = 512  # bpe: vocabulary trained on the training conversations


@dataclass
class GenerateConfig(GenerationConfig):
    """The ``generate:`` section: how replies are generated (``tk chat``, ``tk predict``), and how many
    are written to train.log at each evaluation."""

    num_samples: int = 3  # greedy replies to the first held-out val prompts written to train.log at each evaluation (with the reference); 0 = none; none under FSDP with several processes


class SFTTask(Task):
    """Instruction / chat fine-tuning: the loss on what the assistant says."""

    name: ClassVar[str] = "sft"
    predict_rows: ClassVar[bool] = True  # tk predict RUN rows.jsonl: a conversation per line, in any data format
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"tokenizer": TokenizerConfig, "generate": GenerateConfig}

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.gen_cfg: GenerateConfig = self.sections.get("generate") or GenerateConfig()
        self.tok_cfg: TokenizerConfig = self.sections.get("tokenizer") or TokenizerConfig()
        self.hf: HFSource | None = None
        self.tokenizer: TextTokenizer | None = None
        self.template: ChatTemplate | None = None
        self.meta: dict[str, Any] = {}
        self.splits: dict[str, list[tuple[list[int], list[int]]]] = {}
        self.packed: dict[str, list[list[tuple[list[int], list[int]]]]] = {}
        self._sampled: set[tuple] = set()  # evaluations that already logged their samples
        self._sample_prompts: list[list[dict[str, str]]] | None = None  # the val conversations the samples answer

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        problems = check_data(cfg.sections["data"])
        m = cfg.sections["model"]
        if m.pretrained_from is not None and not is_hf_source(m.pretrained_from):
            problems.append(f"model.pretrained_from: {m.pretrained_from} is not a Hugging Face model folder (with "
                            f"config.json) or a hub id; sft starts from a pretrained decoder or, with null, a new model")
        if m.adapter_from is not None and m.pretrained_from is None:
            problems.append("model.adapter_from: a PEFT adapter needs its base model; set model.pretrained_from to it")
        return problems

    @classmethod
    def check_fresh_run(cls, cfg: Any) -> list[str]:
        """A pretrained source: readable, supported, its tokenizer fits."""
        task = cls(cfg)
        try:
            model_cfg, names = task.model_cfg, {}
            if task.model_cfg.pretrained_from is not None:
                source = HFSource.open(task.model_cfg.pretrained_from)
                model_cfg = source.adopt(task.model_cfg, cfg.given, task.data.max_len)
                source.tokenizer()
                names = source.family_names(model_cfg)
            if model_cfg.lora is not None:  # targets that match nothing: refused before the run dir is written
                with torch.device("meta"):
                    lora = model_cfg.lora
                    apply_lora(DecoderOnlyLM(TransformerConfig.of(model_cfg), 8), lora.rank, lora.alpha, lora.dropout,
                               lora.targets, lora.trainable, names=names)
            if task.model_cfg.adapter_from is not None:
                if task.model_cfg.lora is not None:
                    return ["model.lora: model.adapter_from sets the LoRA (rank, alpha, targets) from the adapter's "
                            "config; remove model.lora"]
                read_adapter(task.model_cfg.adapter_from)
        except TkError as e:
            return [str(e)]
        return []

    # -- set-up ------------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """The model's shape, tokenizer and chat template (kept as task files), then every
        split's conversations encoded, with what was truncated or dropped in train.log."""
        record = read_record(self.files)
        spec = self.model_cfg.pretrained_from
        if not resume and spec is not None:  # every process: each builds (FSDP: reads its shards of) the model
            self.hf = HFSource.open(spec)
            self.model_cfg = self.hf.adopt(self.model_cfg, self.cfg.given, self.data.max_len)
            dtype = str(resolve_dtype(self.model_cfg.dtype, self.hf.files, self.hf.config)).removeprefix("torch.")
            if not self.files.exists(META_FILE):  # the first process writes the task files
                self.hf.keep_files(self.files, {**{k: getattr(self.model_cfg, k) for k in TRANSFORMER_SHAPE_KEYS},
                                                "dtype": dtype})
        elif record is not None:
            self.model_cfg = dataclasses.replace(self.model_cfg, **record["model"])
        if self.model_cfg.adapter_from is not None and self.model_cfg.lora is None:
            lora = adapter_section(self.files, self.model_cfg.adapter_from, self.model_cfg,
                                   self.hf.vocab_size if self.hf is not None else json.loads(
                                       self.files.read_text(META_FILE))["vocab_size"])
            self.model_cfg.lora = self.cfg.sections["model"].lora = lora
        rows = {split: self._rows(split) for split in ("train", "val")}
        self.tokenizer = self._tokenizer(rows["train"])
        self.template = self._template()
        self.meta = self._meta()
        for split, conversations in rows.items():
            counts = Counts()
            encoded = [make_example(*encode_chat(self.tokenizer, self.template, c, self.data.mask), self.data.max_len,
                                    counts, self.data.truncate) for c in conversations]
            self.splits[split] = [e for e in encoded if e is not None]
            log.info("data: %s", counts.line(split))
            if not self.splits[split]:
                raise TkError(f"data: the {split} split has no example with a token to learn ({counts.line(split)}); "
                              f"check data.mask, data.max_len and the chat template")
        self.packed, line = pack_splits(self.splits, self.data.max_len if self.data.packing else None,
                                        self.cfg.train.batch_size, self.cfg.train.seed)  # and the padding share
        log.info("data: %s", line)
        if self.hf is not None or str((record or {}).get("task", "")).startswith("hf:"):
            self.gen_cfg = generation_defaults(self.files, self.gen_cfg, self.cfg.given)
        stops = [i for i in self.meta["eos_ids"] if i not in self.gen_cfg.stop_ids]
        self.gen_cfg = dataclasses.replace(self.gen_cfg, eos_id=self.gen_cfg.eos_id if self.gen_cfg.eos_id is not None
                                           else self.meta["eos_ids"][0],
                                           eos_ids=(self.gen_cfg.eos_ids or []) + stops or None,
                                           pad_id=self.meta["pad_id"] if self.gen_cfg.pad_id is None else self.gen_cfg.pad_id)

    def _rows(self, split: str) -> list[list[dict[str, str]]]:
        """The conversations of a split."""
        d = self.data
        if d.source == "synthetic":
            rows = synthetic_rows(d.num_train if split == "train" else d.num_val, d.seed + (split != "train"))
        elif d.source == "files":
            if split == "val" and d.val_file:
                rows = read_rows(d.val_file, "data.val_file")
            else:
                rows = self._held_out(read_rows(d.train_file, "data.train_file"), split)
        else:
            name = d.val_split if split == "val" and d.val_split else d.hf_split
            rows = list(load_hub_dataset(d.hf_name, d.hf_config, name))
            rows = rows if split == "val" and d.val_split else self._held_out(rows, split)
        return [to_messages(r, d.format, d.system_prompt) for r in renamed(rows, d.columns)]

    def _held_out(self, rows: list[Any], split: str) -> list[Any]:
        cut = len(rows) - max(1, int(len(rows) * self.data.val_fraction))
        return rows[:cut] if split == "train" else rows[cut:]

    def _tokenizer(self, train: list[list[dict[str, str]]]) -> TextTokenizer:
        if self.files.dir is not None and self.files.exists("tokenizer.json"):
            return TextTokenizer.from_str(self.files.read_text("tokenizer.json"))
        if self.hf is not None:
            return self.hf.tokenizer()
        texts = (ChatTemplate(DEFAULT_TEMPLATE).render(c)[0] for c in train)
        tok = build_tokenizer(self.tok_cfg, texts, CHATML_SPECIALS)
        if self.files.dir is not None:
            self.files.write_text("tokenizer.json", tok.to_str())
        return tok

    def _template(self) -> ChatTemplate:
        """The recipe's template, else the run's kept one (the model's own), else ChatML."""
        given = self.data.chat_template
        if given is not None:
            text = Path(given).expanduser().read_text(encoding="utf-8") if given.endswith(".jinja") else given
            specials = read_chat_template(self.files.dir)[1] if self.files.dir is not None else {}
            return ChatTemplate(text, specials)
        if self.files.dir is not None and self.files.dir.is_dir():
            source, specials = read_chat_template(self.files.dir)
            if source is not None:
                return ChatTemplate(source, specials)
        if self.hf is not None:
            source, specials = read_chat_template(self.hf.folder)
            if source is not None:
                return ChatTemplate(source, specials)
        if self.files.dir is not None:  # so that predict and resume render the same way
            self.files.write_text(TEMPLATE_FILE, DEFAULT_TEMPLATE)
        return ChatTemplate(DEFAULT_TEMPLATE, {"eos_token": "<|im_end|>"})

    def _meta(self) -> dict[str, Any]:
        if self.files.dir is not None and self.files.exists(META_FILE):
            return json.loads(self.files.read_text(META_FILE))
        tok = self.tokenizer
        ends = [t for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>") if tok.tok.token_to_id(t) is not None]
        eos = self.template.special_tokens.get("eos_token")
        ids = [tok.tok.token_to_id(t) for t in [*ends, *([eos] if eos else [])]]
        ids = list(dict.fromkeys(i for i in ids if i is not None)) or [0]
        pad = next((tok.tok.token_to_id(t) for t in ("<|endoftext|>", "<pad>", "[PAD]") if tok.tok.token_to_id(t)
                    is not None), ids[0])
        meta = {"vocab_size": self.hf.vocab_size if self.hf is not None else tok.vocab_size, "pad_id": pad,
                "eos_ids": ids}
        if self.files.dir is not None:
            self.files.write_text(META_FILE, json.dumps(meta, indent=1))
        return meta

    # -- data, model, loss ---------------------------------------------------------------
    def build_dataset(self, split: str) -> Dataset:
        split = "train" if split == "train" else "val"
        return ExampleDataset(self.packed[split] if self.data.packing else self.splits[split])

    def collate(self, samples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        return collate_examples(samples, self.meta["pad_id"])

    def build_model(self) -> nn.Module:
        def build() -> DecoderOnlyLM:
            return DecoderOnlyLM(TransformerConfig.of(self.model_cfg), self.meta["vocab_size"])

        if self.hf is not None:
            sharded = self.cfg.train.strategy == "fsdp" and get_world_size() > 1 and self.model_cfg.lora is None
            return self.hf.build(build, self.model_cfg.dtype, sharded)
        model = build()
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.model_cfg.dtype)
        return model.to(dtype) if dtype is not None else model

    def lora_names(self, model: nn.Module) -> dict[str, tuple[str, int, int]]:
        return hf_lora_names(self.files, model, self.model_cfg)

    def init_adapters(self, model: nn.Module) -> None:
        if self.model_cfg.adapter_from is not None:
            init_adapter(self.files, model, self.model_cfg, self.model_cfg.adapter_from)

    def example_inputs(self, model: nn.Module) -> dict[str, Any]:
        return {"tokens": torch.randint(0, self.meta["vocab_size"], (2, 8))}

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Cross-entropy summed over the target tokens; their count is what the engine divides by."""
        logits = model(batch["tokens"], segments=batch.get("segments"))  # (B, T, V); packed rows: block-causal
        loss, count = cross_entropy_sum(logits, batch["targets"], ignore_index=IGNORE)
        return StepOutput(loss=loss, num_items=count, outputs=(logits.detach(), batch["targets"]))

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return {"sft": SFTMetrics()}

    # -- samples at each evaluation ------------------------------------------------------
    def eval_step(self, model: nn.Module, batch: dict[str, Any], ctx: EvalContext) -> StepOutput:
        """The loss; at each evaluation in training also ``generate.num_samples`` replies in train.log."""
        key = (ctx.step, ctx.kind, ctx.index, ctx.key_prefix)
        sharded = self.cfg.train.strategy == "fsdp" and get_world_size() > 1  # a forward on one rank would hang
        if (self.gen_cfg.num_samples > 0 and ctx.kind != "standalone" and ctx.split == "val"  # training only
                and key not in self._sampled and is_main_process() and not sharded):
            self._sampled.add(key)
            self._log_samples(model, ctx)
        return self.loss(model, batch)

    def _log_samples(self, model: nn.Module, ctx: EvalContext) -> None:
        if self._sample_prompts is None:  # the first val conversations that end with the assistant's answer
            answered = (c for c in self._rows("val") if len(c) > 1 and c[-1]["role"] == "assistant")
            self._sample_prompts = [c for _, c in zip(range(self.gen_cfg.num_samples), answered)]
        cfg = dataclasses.replace(self.gen_cfg, strategy="greedy")
        for i, conversation in enumerate(self._sample_prompts):
            try:
                text = self.reply(model, conversation[:-1], cfg)
            except TkError:  # a prompt too long for model.max_len: no sample, not a failed run
                text = "(not generated: the prompt + generate.max_len exceed model.max_len)"
            log.info("%s sample %d at step %d: %r -> %r (reference %r)", ctx.key_prefix, i, ctx.step,
                     conversation[-2]["content"], text, conversation[-1]["content"])

    # -- inference -----------------------------------------------------------------------
    @torch.no_grad()
    def reply(self, model: nn.Module, messages: Sequence[Mapping[str, str]], cfg: GenerationConfig | None = None,
              on_text: Callable[[str], None] | None = None) -> str:
        """The assistant's next message after ``messages`` (the template's generation prompt, then
        tokens until an end-of-turn / eos id), surrounding whitespace stripped.

        ``on_text`` (streaming) gets each new piece of the reply as soon as its token is generated;
        the pieces add up to the returned text.

        Raises:
            TkError: the conversation + ``cfg.max_len`` new tokens exceed ``model.max_len``.
        """
        cfg = cfg or self.gen_cfg
        ids, _ = encode_chat(self.tokenizer, self.template, messages, mask="all", add_generation_prompt=True)
        if len(ids) + cfg.max_len > self.model_cfg.max_len:
            raise TkError(f"the conversation ({len(ids)} tokens) + new tokens ({cfg.max_len}) exceeds model.max_len "
                          f"({self.model_cfg.max_len}); shorten it or lower generate.max_len")
        device = next(model.parameters()).device
        skip = set(cfg.stop_ids) | {cfg.pad_id}

        def text_of(new: Sequence[int]) -> str:
            return self.tokenizer.decode([t for t in new if t not in skip]).strip()

        stream = None if on_text is None else TextStream(text_of, on_text, cfg.stop_ids)
        on_step = stream if cfg.strategy != "beam" else None  # beam search cannot stream: all at the end
        out = generate(model, torch.tensor([ids], device=device), cfg, on_step=on_step).tokens[0].tolist()
        text = text_of(out)
        if stream is not None:
            stream.finish(text)
        return text

    def predict(self, model: nn.Module, inputs: Sequence[str | Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``{"input", "reply"}`` per input: a prompt (a one-message conversation), or a row of any of
        the data formats (what ``tk predict RUN rows.jsonl`` hands over, renamed by ``data.columns``;
        its completion / output may be left out). A conversation that ends with the assistant's
        message is answered without it, and that message is the record's ``reference``.
        ``data.system_prompt`` goes first where a conversation has no system message.

        Raises:
            TkError: a row of no known format, or one with no message to answer.
        """
        out = []
        for item in inputs:
            messages, reference = self._conversation(item)
            record = {"input": item, "reply": self.reply(model, messages)}
            out.append(record if reference is None else {**record, "reference": reference})
        return out

    def _conversation(self, item: str | Mapping[str, Any]) -> tuple[list[dict[str, str]], str | None]:
        """The messages to answer and the reference answer (None: the input has none)."""
        d = self.data
        if isinstance(item, str):
            return to_messages({"prompt": item, "completion": ""}, "prompt_completion", d.system_prompt)[:-1], None
        if not isinstance(item, Mapping):
            raise TkError(f"an input is a JSON {type(item).__name__} ({str(item)[:60]}); give a prompt or a row "
                          f"(prompt/completion, alpaca, messages or conversations)")
        row = next(iter(renamed([item], d.columns)))
        for question, answer in OPEN_ENDED:
            if question in row:
                row.setdefault(answer, "")
        fmt = detect_format(row) if d.format == "auto" else d.format
        try:
            messages = to_messages(row, fmt, d.system_prompt)
        except (KeyError, TypeError) as e:  # a message without role/content, a list where text belongs, ...
            problem = f"no {e} key" if isinstance(e, KeyError) else str(e)
            raise TkError(f"a row does not fit the {fmt} format ({problem}): {json.dumps(item)[:80]}; the formats "
                          f"are in docs/sft.md") from None
        reference = None
        if messages and messages[-1]["role"] == "assistant":
            reference = messages.pop()["content"] or None  # an empty completion: nothing to compare with
        if not any(m["role"] != "system" for m in messages):
            raise TkError(f"a row with no message to answer ({json.dumps(item)[:80]})")
        return messages, reference

