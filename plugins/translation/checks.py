"""The translation recipe's rules, one line per broken one (``TranslationTask.check_config``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tk.plugins.translation.pretrained import source_problem


def config_problems(cfg: Any, decode_default: Any, loss_default: Any, tok_default: Any) -> list[str]:
    """Every problem of the recipe; with ``model.pretrained_from`` the tokenizer and the model's
    shape come from the translator, so only the data and decoding keys are checked here (the
    rest once the folder is read, :meth:`TranslationTask.check_fresh_run`)."""
    data, model = cfg.sections["data"], cfg.sections["model"]
    tok = cfg.sections.get("tokenizer") or tok_default
    problems = _data_problems(data) + _decode_problems(cfg, cfg.sections.get("decode") or decode_default,
                                                       cfg.sections.get("loss") or loss_default)
    if model.pretrained_from is not None:
        return problems + _pretrained_problems(cfg)
    if model.share_embeddings and not tok.joint:
        problems.append("model.share_embeddings: needs one joint vocabulary; set tokenizer.joint=true "
                        "or model.share_embeddings=false")
    if tok.path is not None and not tok.joint:
        problems.append("tokenizer.path: a given tokenizer.json is one joint vocabulary; set tokenizer.joint=true")
    if data.max_len > model.max_len:
        problems.append(f"data.max_len ({data.max_len}) must be <= model.max_len ({model.max_len})")
    if tok.vocab_size < 8:
        problems.append(f"tokenizer.vocab_size ({tok.vocab_size}) must be >= 8")
    if data.src_code is not None or data.tgt_code is not None:
        problems.append("data.src_code / data.tgt_code: language codes belong to a pretrained translator "
                        "(model.pretrained_from); remove them")
    return problems


def _data_problems(data: Any) -> list[str]:
    problems = []
    if data.max_len < 3:
        problems.append(f"data.max_len ({data.max_len}) must be >= 3 (BOS, a token, EOS)")
    if data.max_tokens < data.max_len:
        problems.append(f"data.max_tokens ({data.max_tokens}) must be >= data.max_len ({data.max_len}), "
                        f"or the longest pairs fit in no batch")
    if data.streaming and data.source in ("synthetic", "reverse"):
        problems.append(f"data.streaming is for data.source files, tsv, jsonl or hf (the {data.source} pairs are "
                        f"generated in memory)")
    if data.shuffle_buffer < 1:
        problems.append(f"data.shuffle_buffer ({data.shuffle_buffer}) must be >= 1")
    if data.source == "hf" and not data.hf_name:
        problems.append("data.hf_name: data.source: hf needs a dataset, e.g. wmt14 (and data.hf_config: de-en)")
    if set(data.hf_split) - {"train", "val", "test"}:
        problems.append(f"data.hf_split: keys must be among train, val, test; got {sorted(data.hf_split)}")
    if data.source in ("synthetic", "reverse") and min(data.num_train, data.num_val) < 1:
        problems.append(f"data.num_train ({data.num_train}) and data.num_val ({data.num_val}) must be >= 1")
    return problems


def _decode_problems(cfg: Any, dec: Any, loss: Any) -> list[str]:
    problems = []
    if dec.beam_size < 1 or dec.bleu_every < 0 or dec.batch_size < 1:
        problems.append("decode.beam_size and decode.batch_size must be >= 1, decode.bleu_every >= 0")
    if dec.periodic_beam_size is not None and dec.periodic_beam_size < 1:
        problems.append(f"decode.periodic_beam_size ({dec.periodic_beam_size}) must be >= 1 or null")
    best = cfg.train.best_metric or ""
    if best.endswith(("/bleu", "/chrf")) and dec.bleu_every != 1:
        problems.append(f"train.best_metric ({best!r}) needs BLEU on every evaluation: set decode.bleu_every=1 "
                        f"(now {dec.bleu_every}) or best_metric: val/loss")
    if not 0.0 <= loss.label_smoothing < 1.0:
        problems.append(f"loss.label_smoothing ({loss.label_smoothing}) must be in [0, 1)")
    return problems


def user_set(cfg: Any, section: str, value: Any, name: str) -> bool:
    """Whether the recipe or an override sets ``section.name`` (a value other than the default,
    or an override naming it)."""
    default = getattr(type(value)(), name)
    return f"{section}.{name}" in (cfg.given or ()) or getattr(value, name) != default


def _pretrained_problems(cfg: Any) -> list[str]:
    """The keys a pretrained translator sets itself (its tokenizer)."""
    problem = source_problem(cfg.sections["model"].pretrained_from)
    if problem:
        return [problem]
    tok = cfg.sections.get("tokenizer")
    return [f"tokenizer.{f.name}: the pretrained translator brings its own tokenizer; remove it"
            for f in dataclasses.fields(tok) if user_set(cfg, "tokenizer", tok, f.name)] if tok is not None else []
