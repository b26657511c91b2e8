"""The ``text_classification`` task: labelled text -> trained tokenizer -> core TextEncoder + head."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from tk.core.distill import DistillConfig, check_same_teacher, distillation_loss, teacher_run_problem
from tk.core.engine.inference import (
    SourceRun,
    describe_shape,
    load_backbone,
    open_source,
    write_record,
)
from tk.core.errors import TkError
from tk.core.exchange.hf.bert import (
    bert_config,
    is_hub_id,
    load_bert_weights,
    read_bert_config,
    read_bert_pooler,
    resolve_pretrained_dir,
)
from tk.core.losses import cross_entropy_sum
from tk.core.metrics import Metric
from tk.core.nn.config import TransformerConfig
from tk.core.nn.text_encoder import TextEncoder
from tk.core.optim import OptimConfig, param_groups
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.core.text import BERT_SPECIALS, BERT_TEMPLATE, Encoded, TextTokenizer, build_tokenizer
from tk.plugins.text_classification.data import (
    DataConfig,
    EncodedDataset,
    Row,
    TextClsTokenizerConfig,
    check_data,
    check_length,
    collate_examples,
    iter_rows,
    label_index,
    label_set,
    label_target,
    read_rows,
)
from tk.plugins.text_classification.distill import TextTeacher, check_text_distill
from tk.plugins.text_classification.metrics import build_metrics
from tk.plugins.text_classification.model import ModelConfig, PredictConfig, TextClassifier, uses_pooler
from tk.plugins.text_classification.pretrained import (
    ENCODER_PREFIX,
    SHAPE_KEYS,
    SOURCE_TASKS,
    TOKENIZER_FILE,
    hf_shape_problems,
    tokenizer_and_spec,
)
from tk.plugins.text_classification.stream import row_stream

log = logging.getLogger(__name__)

LABELS_FILE = "labels.json"  # task file: the label values in class-index order
ENCODER_FILE = "encoder.json"  # task file (fine-tuning): the encoder shape read from config.json or the source run



class TextClassificationTask(Task):
    """Text classification: a BERT-style encoder (from scratch or fine-tuned) on CSV/TSV/JSONL, HF datasets or synthetic text."""

    name: ClassVar[str] = "text_classification"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {"tokenizer": TextClsTokenizerConfig, "distill": DistillConfig,
                                                     "predict": PredictConfig}
    renamed_keys: ClassVar[Mapping[str, str]] = {
        "data.tokenizer": "tokenizer.kind", "data.vocab_size": "tokenizer.vocab_size",
        "data.lowercase": "tokenizer.lowercase", "data.hf_splits": "data.hf_split",
        "model.pretrained_dir": "model.pretrained_from"}

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.labels: list[Any] | None = None
        self.tokenizer: TextTokenizer | None = None
        self.encoder_spec: dict[str, Any] | None = None
        self._train_rows: list[Row] | None = None
        self.truncated: dict[str, int] = {}  # split -> examples cut to max_len
        self._pretrained_path: Path | None = None
        self.distill_cfg: DistillConfig = self.sections.get("distill") or DistillConfig()
        self._teacher: TextTeacher | None = None  # the teacher run's task and logits (distillation)
        self._saved_teacher: dict[str, str] | None = None  # the teacher record of the checkpoint being resumed
        self._num_train: int | None = None
        self._source: SourceRun | None | bool = False  # False: model.pretrained_from not opened yet
        self._pooler: bool | None = None  # resolved by the pooler property (or read from a checkpoint)

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        problems = check_data(cfg.sections["data"])
        problems += check_text_distill(cfg.sections.get("distill") or DistillConfig(), cfg.sections["data"].multi_label)
        if cfg.sections["tokenizer"].path is not None and cfg.sections["model"].pretrained_from is not None:
            problems.append("tokenizer.path: model.pretrained_from brings its own tokenizer (its vocabulary matches "
                            "its embeddings); set tokenizer.path to null")
        return problems

    @classmethod
    def check_fresh_run(cls, cfg: Any) -> list[str]:
        """A tk run in ``model.pretrained_from``: readable, of a task with a TextEncoder, with a
        tokenizer file, and of the shape the recipe asks for."""
        task, spec = cls(cfg), cfg.sections["model"].pretrained_from
        try:
            if task.source is not None:
                tokenizer_and_spec(task.model_cfg, task.source, task.data.max_len, cfg.given)
            elif spec is not None and not is_hub_id(spec):  # a local HF folder (a hub id downloads in setup)
                built, _, _ = bert_config(read_bert_config(task.pretrained_path), dropout=task.model_cfg.dropout)
                return hf_shape_problems(task.model_cfg, built, cfg.given)[0]
        except TkError as e:
            return [str(e)]
        distill = cfg.sections.get("distill") or DistillConfig()
        problem = teacher_run_problem(distill.teacher, cls.name) if distill.type != "none" and distill.teacher else None
        return [problem] if problem else []

    @property
    def multi_label(self) -> bool:
        return bool(self.data.multi_label)

    @property
    def distilling(self) -> bool:
        return self.distill_cfg.type != "none"

    @property
    def class_names(self) -> list[Any]:
        """The label values in class-index order (the task file ``labels.json``)."""
        return list(self.labels)

    @property
    def source(self) -> SourceRun | None:
        """The tk run ``model.pretrained_from`` names (None: unset, or an HF folder / hub id)."""
        if self._source is False:
            self._source = open_source(self.model_cfg.pretrained_from, self.name, SOURCE_TASKS)
        return self._source

    @property
    def pretrained_path(self) -> Path:
        """An HF ``model.pretrained_from`` as a local folder (a hub id is downloaded once)."""
        if self._pretrained_path is None:
            self._pretrained_path = resolve_pretrained_dir(self.model_cfg.pretrained_from)
        return self._pretrained_path

    # -- state -----------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Fresh run: label set from the train split, tokenizer trained on it (or the pretrained
        model's), both written as task files. Resume/eval/predict: read back, never retrained."""
        m: ModelConfig = self.model_cfg
        if self.labels is None and self.files.exists(LABELS_FILE):
            self.labels = json.loads(self.files.read_text(LABELS_FILE))
        if self.tokenizer is None and self.files.exists(TOKENIZER_FILE):
            self.tokenizer = TextTokenizer.from_str(self.files.read_text(TOKENIZER_FILE))
        if self.encoder_spec is None and self.files.exists(ENCODER_FILE):
            self.encoder_spec = json.loads(self.files.read_text(ENCODER_FILE))
        if self.labels is None:  # streamed: one pass now, another to train the tokenizer
            self._train_rows = None if self.data.streaming else read_rows(self.data, "train")
            self.labels = label_set(self._train_rows or iter_rows(self.data, "train"), self.data)
            if len(self.labels) < 2 and not self.multi_label:
                raise TkError(f"the train split has {len(self.labels)} label(s) {self.labels}; a classifier needs >= 2")
        if m.pretrained_from is not None and self.encoder_spec is None and self.source is not None:
            tokenizer, self.encoder_spec = tokenizer_and_spec(m, self.source, self.data.max_len, self.cfg.given)  # fresh runs only: later ones read files
            self.tokenizer = self.tokenizer or tokenizer
            if not resume:  # the source's own file, byte for byte: the new run dir is self-contained
                self.source.copy_files(self.files, [TOKENIZER_FILE])
                write_record(self.files, self.source, {k: self.encoder_spec["cfg"][k] for k in SHAPE_KEYS})
        elif m.pretrained_from is not None and self.encoder_spec is None:
            cfg, vocab, types = bert_config(read_bert_config(self.pretrained_path), dropout=m.dropout)
            problems, _ = hf_shape_problems(m, cfg, self.cfg.given) if not resume else ([], [])
            if problems:  # fresh runs only: later ones read encoder.json
                raise TkError(problems[0])
            differ = [f"{k}={getattr(cfg, k)!r} (recipe: {getattr(m, k)!r})" for k in SHAPE_KEYS
                      if hasattr(m, k) and getattr(cfg, k) != getattr(m, k) and k not in ("mlp_ratio", "hidden_dim")]
            if cfg.ffn_dim != TransformerConfig.of(m).ffn_dim:
                differ.append(f"hidden_dim={cfg.ffn_dim} (recipe: {TransformerConfig.of(m).ffn_dim})")
            if differ:  # every key the folder decides, whether the recipe wrote it or left the default
                log.warning("model.pretrained_from: the encoder is built as its config.json says: %s",
                            ", ".join(differ))
            self.encoder_spec = {"cfg": dataclasses.asdict(cfg), "vocab_size": vocab, "type_vocab_size": types}
        if self.tokenizer is None:
            if m.pretrained_from is not None:
                self.tokenizer = TextTokenizer.load(self.pretrained_path, BERT_SPECIALS, key="model.pretrained_from")
            else:
                rows = self._train_rows or iter_rows(self.data, "train")
                texts = (t for r in rows for t in (r[0], r[1]) if t is not None)  # not read when tokenizer.path is set
                self.tokenizer = build_tokenizer(self.sections["tokenizer"], texts, BERT_SPECIALS, BERT_TEMPLATE)
        if self.encoder_spec is not None:  # the shape the encoder is built with (config.yaml records it)
            built = self.encoder_spec["cfg"]
            self.model_cfg = dataclasses.replace(m, **{k: built[k] for k in SHAPE_KEYS if k in built})
        self.model_cfg = dataclasses.replace(self.model_cfg, pooler=self.pooler)
        if not resume and self.run_dir is not None:
            for name, text in ((LABELS_FILE, json.dumps(self.labels, indent=1)), (TOKENIZER_FILE, self.tokenizer.to_str()),
                               (ENCODER_FILE, json.dumps(self.encoder_spec) if self.encoder_spec else None)):
                if text is not None and not self.files.exists(name):
                    self.files.write_text(name, text)

    def state_dict(self) -> dict[str, Any]:
        record = self._teacher.record if self._teacher is not None else self._saved_teacher
        return {"labels": self.labels, "pooler": self.pooler} | \
            ({"teacher": dict(record)} if record is not None else {})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "labels" in state:
            self.labels = list(state["labels"])
            self._pooler = bool(state.get("pooler", False))  # checkpoints from before model.pooler: none
        if "teacher" in state:
            self._saved_teacher = dict(state["teacher"])

    @property
    def pooler(self) -> bool:
        """Whether the classifier has BERT's pooler (:func:`uses_pooler`; a saved run's own choice)."""
        if self._pooler is None:
            self._pooler = uses_pooler(self.model_cfg, self.encoder_spec["cfg"] if self.encoder_spec else None)
        return self._pooler

    @property
    def pad_id(self) -> int:
        return self.tokenizer.token_id("[PAD]")

    @property
    def max_len(self) -> int:
        if self.encoder_spec is not None:
            return min(self.data.max_len, self.encoder_spec["cfg"]["max_len"])
        return self.data.max_len

    # -- data ------------------------------------------------------------------------
    def build_dataset(self, split: str) -> Dataset:
        """Tokenised rows of ``split``; a label not in the train split's set is a TkError naming it and its row."""
        if self.data.streaming:  # rows read in order as they come, encoded in the loader worker
            return row_stream(self.data, split, self.tokenizer, self.labels, self.max_len, self.distilling)
        rows = self._train_rows if split == "train" and self._train_rows is not None else read_rows(self.data, split)
        index = label_index(self.labels)
        targets = [label_target(label, where, self.labels, self.multi_label, index) for _, _, label, where in rows]
        pairs = [r[1] for r in rows] if self.data.text_pair_column else None
        enc = self.encode([r[0] for r in rows], pairs)
        if enc.truncated:  # a warning: those examples lose text
            log.warning("%s split: %d of %d examples truncated to %d tokens (data.max_len)", split, enc.truncated,
                        len(rows), self.max_len)
        self.truncated[split] = enc.truncated
        items = [{"input_ids": i, "token_types": t, "labels": y} for i, t, y in zip(enc.ids, enc.type_ids, targets)]
        if split == "train" and self.distilling:  # the teacher reads the raw texts with its own tokenizer
            self._num_train = len(items)
            for index, (item, row) in enumerate(zip(items, rows)):
                item.update(text=row[0], pair=row[1], index=index)
        return EncodedDataset(items)

    def encode(self, texts: Sequence[str], pairs: Sequence[str] | None) -> Encoded:
        """``[CLS] A [SEP] (B [SEP])`` ids and token types, cut to :attr:`max_len` (counted)."""
        return self.tokenizer.encode_batch(texts, pairs, max_length=self.max_len)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Pad to the longest example (dynamic padding); with ``data.pack``, labelled batches
        are packed into rows of :attr:`max_len` tokens (:func:`.data.collate_examples`)."""
        return collate_examples(samples, self.pad_id, self.multi_label, self.max_len if self.data.pack else None)

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        m: ModelConfig = self.model_cfg
        if self.encoder_spec is not None:
            cfg = TransformerConfig(**self.encoder_spec["cfg"])
            vocab, types = self.encoder_spec["vocab_size"], self.encoder_spec["type_vocab_size"]
        else:
            cfg = TransformerConfig.of(m, max_len=self.data.max_len)
            vocab, types = self.tokenizer.vocab_size, 2
        encoder = TextEncoder(cfg, vocab, type_vocab_size=types, pad_id=self.pad_id)
        return TextClassifier(encoder, len(self.labels), m.pooling, m.head_dropout, pooler=self.pooler)

    def example_inputs(self, model: nn.Module) -> dict[str, Any]:
        """``tk export``: a padded batch of two tokenised sentences of different lengths."""
        enc = self.encode(["an example", "a longer example sentence to trace"], None)
        rows = [{"input_ids": i, "token_types": t} for i, t in zip(enc.ids, enc.type_ids)]
        return {"input_ids": self.collate(rows)["input_ids"]}

    def init_pretrained(self, model: nn.Module) -> None:
        """Fine-tuning: copy ``model.pretrained_from``'s encoder weights (a tk run's, or an HF
        folder's) into the encoder; the head stays new (fresh runs only)."""
        if self.model_cfg.pretrained_from is None:
            return
        pooler = None
        if self.source is not None:
            loaded = len(load_backbone(model, self.source.weights(), prefix=ENCODER_PREFIX))
            origin = f"{self.source.spec} ({self.source.task} run, {self.source.checkpoint.name})"
            self._source = None  # done: drop the mapped checkpoint
        else:
            load_bert_weights(model.encoder, self.pretrained_path)
            loaded, origin = len(model.encoder.state_dict()), f"{self.model_cfg.pretrained_from} (BERT)"
            pooler = read_bert_pooler(self.pretrained_path) if model.pooler is not None else None
            if pooler is not None:  # BERT's pretrained pooler, as transformers' fine-tuning starts from it
                model.pooler.load_state_dict(pooler)
        fresh = (["pooler"] if model.pooler is not None and pooler is None else []) + [f"head ({len(self.labels)} classes)"]
        log.info("model.pretrained_from: %d encoder tensors from %s%s; new: %s; shape: %s", loaded, origin,
                 ", and its pooler" if pooler is not None else "", ", ".join(fresh),
                 describe_shape(model.encoder.cfg))

    def param_groups(self, model: nn.Module, optim_cfg: OptimConfig) -> list[dict[str, Any]]:
        """Encoder parameters at ``optim.lr * model.encoder_lr_scale``, the head at ``optim.lr``;
        with ``optim.layer_decay`` d, encoder layer i (of L) also gets ``d ** (L - i)`` and the
        embeddings ``d ** (L + 1)`` (ids from :meth:`TextClassifier.layer_id`)."""
        scale = self.model_cfg.encoder_lr_scale
        return param_groups(model, optim_cfg, lr_scale=lambda n: scale if n.startswith("encoder.") else 1.0)

    def build_teacher(self) -> nn.Module | None:
        """The frozen teacher of ``distill.teacher`` (None without distillation): a finished
        text_classification run with the same labels, whatever its tokenizer.

        Raises:
            TkError: a missing or non-run path, a run of another task, other labels, other
                inputs (pairs vs single texts), or (resuming) another teacher than the
                checkpoint recorded.
        """
        if not self.distilling:
            return None
        teacher = TextTeacher(self.distill_cfg, self, self._num_train)
        check_same_teacher(self._saved_teacher, teacher.record)
        self._teacher = teacher
        return teacher.model

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Cross-entropy (multi-label: binary cross-entropy summed over the C labels) summed over
        the batch; ``outputs`` are the (B, C) logits. In training with ``distill.type`` soft/hard,
        ``(1 - alpha) * CE + alpha * distillation term`` against the teacher's logits on the
        same texts (:func:`tk.core.distill.distillation_loss`)."""
        segments = batch.get("segments")  # a packed batch (data.pack); other models never see the argument
        logits = model(batch["input_ids"], batch["token_types"]) if segments is None else \
            model(batch["input_ids"], batch["token_types"], segments=segments)
        if model.training and self.teacher is not None and self._teacher is not None:
            teacher_logits = self._teacher.logits(self.teacher, batch)
            loss, count, logs = distillation_loss(self.distill_cfg, logits, batch["labels"], teacher_logits)
            return StepOutput(loss=loss, num_items=count, logs=logs, outputs=logits.detach())
        if self.multi_label:
            target = batch["labels"]
            loss = F.binary_cross_entropy_with_logits(logits.float(), target.float(), reduction="sum")
            return StepOutput(loss=loss, num_items=target.shape[0], outputs=logits.detach())
        loss, count = cross_entropy_sum(logits, batch["labels"])
        return StepOutput(loss=loss, num_items=count, outputs=logits.detach())

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        return build_metrics(self.labels or [], self.multi_label, self.model_cfg.threshold)  # [] before set-up: keys only

    # -- inference ---------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """Label and class probabilities of each text line (a pair task: the two texts tab-separated).

        Returns:
            One dict per input, in order: ``{"label": value, "probs": {label: p, ...}}``; multi-label:
            ``{"labels": [values with p > model.threshold], "probs": {label: sigmoid p, ...}}``.
        """
        pairs = None
        texts = list(inputs)
        if any(not t.strip() for t in texts):  # the engine then retries one input at a time: an error each
            raise TkError("the text is empty; a classifier needs words to label")
        if self.data.text_pair_column:
            split = [t.split("\t", 1) for t in texts]
            bad = [t for t, s in zip(texts, split) if len(s) != 2]
            if bad:
                raise TkError(f"{bad[0]!r}: this run classifies text pairs; give the two texts separated by a tab")
            texts, pairs = [s[0] for s in split], [s[1] for s in split]
        truncate = (self.sections.get("predict") or PredictConfig()).truncate
        check_length(self.tokenizer, texts, pairs, self.max_len, truncate)
        enc = self.encode(texts, pairs)
        batch = self.collate([{"input_ids": i, "token_types": t} for i, t in zip(enc.ids, enc.type_ids)])
        device = next(model.parameters()).device
        model.eval()
        logits = model(batch["input_ids"].to(device), batch["token_types"].to(device)).float().cpu()
        names = [str(lab) for lab in self.labels]
        if self.multi_label:
            t = self.model_cfg.threshold
            return [{"labels": [lab for lab, q in zip(self.labels, p.tolist()) if q > t],
                     "probs": dict(zip(names, p.tolist()))} for p in logits.sigmoid()]
        probs = logits.softmax(-1)
        return [{"label": self.labels[int(p.argmax())], "probs": dict(zip(names, p.tolist()))} for p in probs]
