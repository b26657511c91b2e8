"""The ``translation`` task: parallel data, subword tokenizers, a Transformer
encoder-decoder, label-smoothed training, greedy/beam decoding and sacreBLEU."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from tk.core.data.loader import LoaderSpec, build_loader
from tk.core.data.samplers import TokenBudgetBatchSampler
from tk.core.errors import TkError
from tk.core.exchange.hf.peft import linear_names
from tk.core.exchange.hf.seq2seq import export_seq2seq, seq2seq_family
from tk.core.exchange.pretrained import TRANSFORMER_SHAPE_KEYS, adopt_shape, read_record
from tk.core.losses import cross_entropy_sum
from tk.core.metrics import Metric
from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation import GenerationConfig, generate
from tk.core.nn.transformer import EncoderDecoder
from tk.core.step import EvalContext, StepOutput
from tk.core.task import Task
from tk.core.text import Perplexity, TextTokenizer
from tk.plugins.translation.checks import config_problems, user_set
from tk.plugins.translation.data import (
    SPECIALS,
    DataConfig,
    Framing,
    ParallelDataset,
    TokenizerConfig,
    collate_pairs,
    iter_pairs,
    pair_stream,
    read_pairs,
)
from tk.plugins.translation.metrics import CorpusBleu
from tk.plugins.translation.model import ModelConfig
from tk.plugins.translation.pretrained import (
    Translator,
    framing_of,
    saved_generation,
    saved_tokenizers,
)

JOINT_FILE, SRC_FILE, TGT_FILE = "tokenizer.json", "tokenizer.src.json", "tokenizer.tgt.json"
log = logging.getLogger(__name__)
DROPOUTS = ("dropout", "attn_dropout", "mlp_dropout")
DATA_REPORT = "data_report.json"  # task file: pairs kept / dropped per split


@dataclass
class DecodeConfig:
    """The recipe's ``decode:`` section: how hypotheses for BLEU and ``tk translate`` are made."""

    beam_size: int = 1  # 1 = greedy search; > 1 = beam search with that many beams
    length_penalty: float = 1.0  # beam: score = log-prob / length**length_penalty
    max_len_a: float = 1.5  # longest output = max_len_a * source tokens + max_len_b
    max_len_b: int = 10  # see max_len_a
    bleu_every: int = 1  # BLEU/chrF on every n-th periodic evaluation (and always at the end)
    periodic_beam_size: int | None = None  # beam at periodic (mid-training) evaluations; None = beam_size
    batch_size: int = 64  # tk translate: lines per decoding batch


@dataclass
class LossConfig:
    """The recipe's ``loss:`` section."""

    label_smoothing: float = 0.1  # epsilon of label-smoothed cross-entropy (training only)


class TranslationTask(Task):
    """Machine translation: Transformer encoder-decoder on parallel text, scored with sacreBLEU."""

    name: ClassVar[str] = "translation"
    DataConfig: ClassVar[type] = DataConfig
    ModelConfig: ClassVar[type] = ModelConfig
    extra_sections: ClassVar[Mapping[str, type]] = {
        "tokenizer": TokenizerConfig, "decode": DecodeConfig, "loss": LossConfig,
    }
    renamed_keys: ClassVar[Mapping[str, str]] = {
        "data.lowercase": "tokenizer.lowercase",
        "data.hf_val_split": "was renamed to data.hf_split, a mapping of tk split to dataset split; write "
                             "`data: {hf_split: {train: train, val: validation, test: test}}`",
        "train.best_metric=val/ppl": "train.best_metric=val/perplexity",
    }

    def __init__(self, cfg: Any, run_dir: Any = None) -> None:
        super().__init__(cfg, run_dir)
        self.tok_cfg: TokenizerConfig = self.sections.get("tokenizer") or TokenizerConfig()
        self.decode_cfg: DecodeConfig = self.sections.get("decode") or DecodeConfig()
        self.loss_cfg: LossConfig = self.sections.get("loss") or LossConfig()
        self.src_tok: TextTokenizer | None = None
        self.tgt_tok: TextTokenizer | None = None  # the same object as src_tok when joint
        self.pad_id = self.bos_id = self.eos_id = -1  # the specials' ids, set by setup
        self.framing: Framing | None = None  # how a pair becomes ids (set by setup)
        self.hf: Translator | None = None  # model.pretrained_from's translator (a fresh run only)
        self._datasets: dict[str, ParallelDataset] = {}
        self.tokenizer_trained = False  # True only where this process trained the tokenizer(s) (not given ones)

    @classmethod
    def check_config(cls, cfg: Any) -> list[str]:
        return config_problems(cfg, DecodeConfig(), LossConfig(), TokenizerConfig())

    @classmethod
    def check_fresh_run(cls, cfg: Any) -> list[str]:
        """A ``model.pretrained_from`` translator: readable, of a family tk maps, its tokenizer
        files present, the language codes known, ``data.max_len`` within its positions."""
        if cfg.sections["model"].pretrained_from is None:
            return []
        try:
            cls(cfg)._open_hf(write=False)
        except TkError as e:
            return [str(e)]
        return []

    def _open_hf(self, write: bool) -> None:
        """The translator of ``model.pretrained_from``: its shape (recipe keys must agree), tokenizers, framing."""
        self.hf = Translator(self.model_cfg.pretrained_from)
        self.model_cfg = adopt_shape(self.model_cfg, self.hf.fields, TRANSFORMER_SHAPE_KEYS, self.cfg.given)
        own = {k: self.hf.fields[k] for k in DROPOUTS  # the model's own dropouts where the recipe sets none
               if k in self.hf.fields and not user_set(self.cfg, "model", self.model_cfg, k)}
        self.model_cfg = dataclasses.replace(self.model_cfg, **own)
        if self.data.max_len > self.model_cfg.max_len:
            raise TkError(f"data.max_len ({self.data.max_len}) exceeds the model's {self.model_cfg.max_len} positions "
                          f"(config.json max_position_embeddings); lower data.max_len")
        self._use(*self.hf.tokenizers(), self.hf.config, self.hf.generation())
        if write:
            self.hf.keep_files(self.files, {k: getattr(self.model_cfg, k) for k in TRANSFORMER_SHAPE_KEYS + DROPOUTS})

    def _use(self, src_tok: Any, tgt_tok: Any, config: dict, generation: dict) -> None:
        self.src_tok, self.tgt_tok = src_tok, tgt_tok
        self.framing = framing_of(config, generation, src_tok, self.data.src_code, self.data.tgt_code)
        self.pad_id, self.bos_id, self.eos_id = self.framing.pad, self.framing.bos, self.framing.eos
        gen = self.framing.generation  # the model's decoding where the recipe is silent
        found = {"beam_size": gen.get("num_beams"), "length_penalty": gen.get("length_penalty")}
        self.decode_cfg = dataclasses.replace(self.decode_cfg, **{
            k: v for k, v in found.items() if v is not None and not user_set(self.cfg, "decode", self.decode_cfg, k)})

    # -- tokenizers ------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Train the tokenizer(s) on the train split and save them as task files (fresh
        run), or load the saved ones (resume, eval, translate: never retrained)."""
        record = read_record(self.files) if self.run_dir is not None else None
        if not resume and self.model_cfg.pretrained_from is not None:  # every rank: each loads the weights
            return self._open_hf(write=True)
        if record is not None and str(record.get("task", "")).startswith("hf:"):  # resume, eval, translate
            self.model_cfg = dataclasses.replace(self.model_cfg, **record["model"])
            config = json.loads(self.files.read_text("hf_config.json"))
            return self._use(*saved_tokenizers(self.files), config, saved_generation(self.files))
        names = [JOINT_FILE] if self.tok_cfg.joint else [SRC_FILE, TGT_FILE]
        if all(self.files.exists(n) for n in names) and self.run_dir is not None:
            toks = [TextTokenizer.from_str(self.files.read_text(n), str(self.files.path(n))) for n in names]
        elif resume:
            raise TkError(f"{self.files.path(names[0])} is missing: this run's tokenizer is gone; restore the "
                          f"run's artifacts/ folder (a tokenizer is never retrained on resume)")
        else:
            toks = self._build_tokenizers()
            self.tokenizer_trained = self.tok_cfg.path is None
            if self.run_dir is not None:
                for name, tok in zip(names, toks):
                    self.files.write_text(name, tok.to_str())
        self.src_tok, self.tgt_tok = toks[0], toks[-1]
        self.framing = Framing.of(self.tgt_tok)  # <pad> <s> </s>
        self.pad_id, self.bos_id, self.eos_id = self.framing.pad, self.framing.bos, self.framing.eos

    def _build_tokenizers(self) -> list[TextTokenizer]:
        if self.tok_cfg.path is not None:  # one joint vocabulary (check_config)
            return [TextTokenizer.load(self.tok_cfg.path, required_specials=SPECIALS)]
        if self.data.streaming:  # a pass over the train pairs per side, nothing kept in memory
            def side(k: int):
                return (self._norm(p)[k] for p in iter_pairs(self.data, "train", streaming=True))
        else:
            pairs = [self._norm(p) for p in read_pairs(self.data, "train")]

            def side(k: int):
                return (p[k] for p in pairs)
        if self.tok_cfg.joint:  # all sources, then all targets
            return [TextTokenizer.train(chain(side(0), side(1)), self.tok_cfg, SPECIALS)]
        return [TextTokenizer.train(side(k), self.tok_cfg, SPECIALS) for k in (0, 1)]

    def _norm(self, pair: tuple[str, str]) -> tuple[str, str]:
        """Lowercased with tokenizer.lowercase: the references too, so BLEU compares like with like."""
        return (pair[0].lower(), pair[1].lower()) if self.tok_cfg.lowercase else pair

    # -- data ------------------------------------------------------------------------
    def build_dataset(self, split: str) -> ParallelDataset:
        """Tokenised pairs of ``split`` (see :class:`ParallelDataset` for the dropping rules)."""
        if split not in self._datasets:
            pairs = [self._norm(p) for p in read_pairs(self.data, split)]
            ds = ParallelDataset(pairs, self.src_tok, self.tgt_tok, self.data.max_len, self.framing)
            if len(ds) == 0:
                raise TkError(f"the {split} split has no usable pairs ({len(pairs)} read, dropped {ds.dropped}); "
                              f"check the data files or raise data.max_len ({self.data.max_len})")
            share = ds.dropped["too_long"] / max(len(pairs), 1)
            # in train.log during a run (tk.* messages); more than 5% lost says which key keeps them
            (log.warning if share > 0.05 else log.info)(
                "translation: %s: %d pairs kept of %d; dropped %d empty and %d longer than data.max_len=%d tokens%s",
                split, len(ds), len(pairs), ds.dropped["empty"], ds.dropped["too_long"], self.data.max_len,
                f" ({share:.0%} of the pairs: raise data.max_len to keep them)" if share > 0.05 else "")
            self._write_report(split, len(pairs), ds)
            self._datasets[split] = ds
        return self._datasets[split]

    def _write_report(self, split: str, read: int, ds: ParallelDataset) -> None:
        if self.run_dir is None:
            return
        try:
            report = json.loads(self.files.read_text(DATA_REPORT)) if self.files.exists(DATA_REPORT) else {}
            report[split] = {"read": read, "kept": len(ds), "dropped": ds.dropped}
            self.files.write_text(DATA_REPORT, json.dumps(report, indent=1))
        except OSError:  # a read-only run dir (eval of a copied run) keeps the console line only
            pass

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return collate_pairs(samples, self.pad_id)

    def build_loader(self, split: str, spec: LoaderSpec) -> DataLoader:
        """Token-budget batches (``data.max_tokens`` padded tokens), built by length; streamed
        training pairs (``data.streaming``) come ``train.batch_size`` to a batch."""
        if self.data.streaming and split == "train":
            stream = pair_stream(self.data, split, self.src_tok, self.tgt_tok, self.tok_cfg.lowercase, self.framing)
            return build_loader(stream, spec, self.collate)
        ds = self.build_dataset(split)
        sampler = TokenBudgetBatchSampler.from_spec(spec, ds.lengths, self.data.max_tokens)
        return build_loader(ds, spec, self.collate, batch_sampler=sampler)

    # -- model and loss ----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The encoder-decoder; with a pretrained translator (a fresh run) its weights, loaded on the meta device."""
        record = read_record(self.files) if self.run_dir is not None else None
        if self.hf is not None or record is not None and str(record.get("task", "")).startswith("hf:"):
            vocab = self.hf.vocab_size if self.hf is not None else int(json.loads(
                self.files.read_text("hf_config.json"))["vocab_size"])
            build = lambda: EncoderDecoder(self.model_cfg, vocab, vocab, pad_id=self.pad_id)  # noqa: E731
            if self.hf is not None:
                return self.hf.build(build, self.model_cfg.dtype)
            model = build()
            dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.model_cfg.dtype)
            return model.to(dtype) if dtype is not None else model
        return EncoderDecoder(self.model_cfg, self.src_tok.vocab_size, self.tgt_tok.vocab_size, pad_id=self.pad_id)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Teacher forcing: ``model(src, tgt_in)`` predicts ``tgt_out``; label-smoothed CE
        (training only) summed over non-PAD target tokens."""
        logits = model(batch["src"], batch["tgt_in"])  # (B, Tt, V)
        eps = self.loss_cfg.label_smoothing if model.training else 0.0
        loss, count = cross_entropy_sum(logits, batch["tgt_out"], label_smoothing=eps, ignore_index=self.pad_id)
        return StepOutput(loss=loss, num_items=count)

    def eval_step(self, model: nn.Module, batch: dict[str, Any], ctx: EvalContext) -> StepOutput:
        out = self.loss(model, batch)
        if ctx.every(self.decode_cfg.bleu_every):
            beam = self.decode_cfg.periodic_beam_size if ctx.kind == "periodic" else None
            hyps = self.decode(model, batch["src"], beam)
            out.outputs = {"hyps": list(zip(batch["id"].tolist(), hyps))}
        return out

    def build_metrics(self, ctx: EvalContext) -> dict[str, Metric]:
        metrics: dict[str, Metric] = {"perplexity": Perplexity()}
        if ctx.every(self.decode_cfg.bleu_every):
            ds = self._datasets.get(ctx.split)
            refs, sources = (ds.refs, ds.sources) if ds is not None else ([], [])
            metrics["bleu"] = CorpusBleu(refs, sources)
        return metrics

    # -- decoding ------------------------------------------------------------------------
    def generation_config(self, src_len: int, beam_size: int | None = None) -> GenerationConfig:
        """Core generation settings for a source batch of ``src_len`` tokens."""
        d, f = self.decode_cfg, self.framing
        beam = d.beam_size if beam_size is None else beam_size
        limit = self.model_cfg.max_len - 1 - len(f.tgt_prefix)
        if f.generation.get("max_length"):  # the model's own cap (its decoder start counted, as there)
            limit = min(limit, int(f.generation["max_length"]) - 1)
        max_len = max(1, min(int(d.max_len_a * src_len) + d.max_len_b, limit))
        # a pretrained translator stops its beams as transformers does (early_stopping false: a heuristic)
        stop = "bound" if not self.framing.generation or f.generation.get("early_stopping") == "never" else "heuristic"
        return GenerationConfig(strategy="beam" if beam > 1 else "greedy", beam_size=beam, max_len=max_len,
                                length_penalty=d.length_penalty, bos_id=self.bos_id, eos_id=self.eos_id,
                                pad_id=self.pad_id, forced_bos_id=f.forced_bos, forced_eos=f.forced_eos,
                                beam_stop=stop)

    def decode(self, model: nn.Module, src: torch.Tensor, beam_size: int | None = None) -> list[str]:
        """Detokenised translations of a padded source batch (B, Ts)."""
        out = generate(model, src, self.generation_config(src.shape[1], beam_size))
        return self.tgt_tok.decode_batch(out.tokens.tolist())

    def _source_texts(self, lines: Sequence[str]) -> list[str]:
        return [line.strip().lower() if self.tok_cfg.lowercase else line.strip() for line in lines]

    def too_long(self, lines: Sequence[str]) -> list[tuple[int, int]]:
        """``(index, tokens)`` of each line with more tokens than the model takes (``model.max_len``
        less one for EOS)."""
        ids = self.src_tok.encode_batch(self._source_texts(lines), add_special_tokens=False).ids
        return [(i, len(s)) for i, s in enumerate(ids) if len(s) > self._source_limit()]

    def _source_limit(self) -> int:
        """Source tokens a line may have: the positions less EOS and the language code."""
        return self.model_cfg.max_len - 1 - len(self.framing.src_prefix)

    def too_long_message(self, tokens: int) -> str:
        limit, extra = self._source_limit(), " and the language code" if self.framing.src_prefix else ""
        return (f"{tokens} tokens, more than the {limit} this model takes (model.max_len {self.model_cfg.max_len}, "
                f"one for EOS{extra}); split the line, or pass --truncate to translate its first {limit} tokens")

    @torch.no_grad()
    def translate(self, model: nn.Module, lines: Sequence[str], beam_size: int | None = None,
                  truncate: bool = False) -> list[str]:
        """Translate raw source lines (an empty line gives an empty translation).

        Raises:
            TkError: a line has more tokens than the model takes, unless ``truncate`` (its first
                tokens are translated).
        """
        long = [] if truncate else self.too_long(lines)
        if long:
            raise TkError(self.too_long_message(long[0][1]))
        texts = self._source_texts(lines)
        keep = [i for i, t in enumerate(texts) if t]
        results = [""] * len(texts)
        if not keep:
            return results
        ids = self.src_tok.encode_batch([texts[i] for i in keep], add_special_tokens=False,
                                        max_length=self._source_limit()).ids
        seqs = [torch.tensor([*self.framing.src_prefix, *s, self.eos_id]) for s in ids]
        src = pad_sequence(seqs, batch_first=True, padding_value=self.pad_id).to(next(model.parameters()).device)
        for i, hyp in zip(keep, self.decode(model.eval(), src, beam_size)):
            results[i] = hyp
        return results

    def lora_names(self, model: nn.Module) -> dict[str, tuple[str, int, int]]:
        """A pretrained translator's own Linear names (``q_proj``, ``fc1``, ...) for ``model.lora.targets``
        and the PEFT export (``{}`` for a translator trained from scratch)."""
        if not self.files.exists("hf_config.json") and self.hf is None:
            return {}
        config = self.hf.config if self.hf is not None else json.loads(self.files.read_text("hf_config.json"))
        return linear_names(seq2seq_family(config), model, TransformerConfig.of(self.model_cfg))

    def export_hf(self, model: nn.Module) -> tuple[dict, dict]:
        """``tk export --format hf``: a run started from a Hugging Face translator, as its family
        (its config keys kept, the tokenizer files written beside it by the export)."""
        if not self.files.exists("hf_config.json"):
            raise TkError("--format hf: this translator was trained from scratch with tk's tokenizer, which no "
                          "transformers translator class reads; export --format safetensors "
                          "(runs started from a Marian or NLLB model, model.pretrained_from, export as their family)")
        source = json.loads(self.files.read_text("hf_config.json"))
        return export_seq2seq(model, self.model_cfg, source["model_type"], source)

    def predict(self, model: nn.Module, inputs: Sequence[str]) -> list[dict[str, Any]]:
        """``tk predict``: ``{"input": line, "translation": text}`` per source line."""
        return [{"input": s, "translation": t} for s, t in zip(inputs, self.translate(model, inputs))]
