"""``tk export --format hf``: a trained core model as a Hugging Face ``transformers`` folder.

What maps to what (the inverse of :mod:`tk.core.exchange.hf.bert` for the encoder):

- a text classifier (core :class:`TextEncoder` + BERT's pooler + linear head), BERT-shaped
  (learned positions, post-norm LayerNorm, GELU/ReLU, biases, [CLS] pooling, ``model.pooler``)
  -> ``BertForSequenceClassification``, tensor for tensor; a masked LM (the encoder + BERT's
  prediction head) -> ``BertForMaskedLM``;
- a :class:`DecoderOnlyLM` started from a Hugging Face decoder -> the same family (GPT-2, Llama,
  Mistral, Qwen2/3, Phi-3, Gemma 1/2: :mod:`tk.core.exchange.hf`), its config keys kept; one
  trained from scratch with learned positions + LayerNorm -> ``GPT2LMHeadModel``, with rotary
  positions + RMSNorm + SwiGLU -> ``LlamaForCausalLM``.

Any other shape raises a one-line :class:`TkError` naming the config key and its value.
The folder is written by hand (``config.json``, ``model.safetensors``): exporting needs no
``transformers``; loading it does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tk.core.errors import TkError
from tk.core.exchange.export import export_safetensors, state_with_norm_biases
from tk.core.exchange.hf.decoders import export_decoder, family_of
from tk.core.exchange.hf.peft import export_adapter
from tk.core.exchange.hf.seq2seq import FAMILIES as SEQ2SEQ
from tk.core.exchange.pretrained import RECORD_FILE
from tk.core.nn.lora import has_lora
from tk.core.nn.config import TransformerConfig
from tk.core.nn.text_encoder import TextEncoder
from tk.core.nn.transformer import DecoderOnlyLM

__all__ = ["bert_export", "bert_mlm_export", "hf_export", "lm_export", "write_hf_folder"]

HF_SOURCE_CONFIG = "hf_config.json"  # task file of a run started from a Hugging Face model: its config.json
KEPT_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json",
              "source.spm", "target.spm", "vocab.json")  # the last three: Marian's tokenizer
_SPECIALS = {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
             "mask_token": "[MASK]"}


def _refuse(key: str, value: Any, target: str, need: str) -> TkError:
    return TkError(f"--format hf: {key}={value!r} has no {target} counterpart ({need}); "
                   f"export --format safetensors, torch-export or onnx instead")


def _require(cfg: TransformerConfig, target: str, rules: dict[str, tuple[Any, ...]],
             found: list[str] | None = None) -> None:
    """Raise one line naming every field of ``cfg`` whose value is not among the allowed ones (and the
    blockers already ``found`` by the caller): every blocker at once, before anyone retrains."""
    problems = list(found or [])
    for name, allowed in rules.items():
        value = cfg.use_final_norm if name == "final_norm" else getattr(cfg, name)
        if value not in allowed:
            problems.append(f"model.{name}={value!r} (it needs {' or '.join(map(repr, allowed))})")
    if cfg.num_kv_heads not in (None, cfg.num_heads) and target != "LlamaForCausalLM":
        problems.append(f"model.num_kv_heads={cfg.num_kv_heads!r} (it has no grouped-query attention)")
    if problems:
        raise TkError(f"--format hf: {target} cannot express {len(problems)} of this model's settings: "
                      + "; ".join(problems) + "; export --format safetensors, torch-export or onnx instead")


def _qkv(sd: dict[str, Tensor], prefix: str, cfg: TransformerConfig) -> list[tuple[Tensor, Tensor | None]]:
    """The stacked ``qkv`` projection of a layer split into (weight, bias) of q, k, v."""
    head_dim = cfg.dim // cfg.num_heads
    kv = (cfg.num_kv_heads or cfg.num_heads) * head_dim
    sizes = [cfg.dim, kv, kv]
    weights = sd[f"{prefix}.weight"].split(sizes)
    biases = sd[f"{prefix}.bias"].split(sizes) if f"{prefix}.bias" in sd else [None] * 3
    return list(zip(weights, biases))


# -- BERT ------------------------------------------------------------------------------
def _bert_encoder(model: nn.Module, target: str, found: list[str] | None = None
                  ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``bert.embeddings.*`` + ``bert.encoder.*`` tensors and the config keys they share, for
    ``model.encoder`` (a :class:`TextEncoder`) of a text classifier or a masked LM (``found``: the
    caller's blockers, refused together with the encoder's)."""
    enc: TextEncoder = model.encoder
    cfg = enc.cfg
    _require(cfg, target, {"pos_encoding": ("learned",), "norm": ("layernorm",), "norm_first": (False,),
                           "final_norm": (False,), "activation": ("gelu", "relu"), "bias": (True,)}, found)
    sd = state_with_norm_biases(model)
    out = {"bert.embeddings.word_embeddings.weight": sd["encoder.tok_embed.weight"],
           "bert.embeddings.position_embeddings.weight": sd["encoder.pos_embed.weight"],
           "bert.embeddings.LayerNorm.weight": sd["encoder.embed_norm.weight"],
           "bert.embeddings.LayerNorm.bias": sd["encoder.embed_norm.bias"]}
    # BERT always adds a token-type embedding: one zero row stands for "none"
    types = sd.get("encoder.type_embed.weight", torch.zeros(1, cfg.dim))
    out["bert.embeddings.token_type_embeddings.weight"] = types
    for i in range(cfg.depth):
        src, dst = f"encoder.encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        for name, (w, b) in zip(("query", "key", "value"), _qkv(sd, f"{src}self_attn.qkv", cfg)):
            out[f"{dst}attention.self.{name}.weight"], out[f"{dst}attention.self.{name}.bias"] = w, b
        for a, b in (("attention.output.dense", "self_attn.proj"), ("attention.output.LayerNorm", "norm1"),
                     ("intermediate.dense", "mlp.fc1"), ("output.dense", "mlp.fc2"), ("output.LayerNorm", "norm2")):
            for kind in ("weight", "bias"):
                out[f"{dst}{a}.{kind}"] = sd[f"{src}{b}.{kind}"]
    config = {
        "architectures": [target], "model_type": "bert", "vocab_size": sd["encoder.tok_embed.weight"].shape[0],
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_dim, "hidden_act": cfg.activation, "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout_p, "max_position_embeddings": cfg.max_len,
        "type_vocab_size": types.shape[0], "layer_norm_eps": cfg.norm_eps, "pad_token_id": enc.pad_id,
        "position_embedding_type": "absolute", "torch_dtype": "float32",
    }
    return out, config


def bert_export(model: nn.Module, labels: list[Any] | None, multi_label: bool = False) -> tuple[dict, dict]:
    """``(config.json dict, state dict)`` of ``BertForSequenceClassification`` for a tk
    text classifier (``model.encoder`` a :class:`TextEncoder`, ``model.pooler`` BERT's pooler,
    ``model.head`` a linear layer), tensor for tensor.

    Raises:
        TkError: a shape BERT cannot express, naming the key and value.
    """
    target = "BertForSequenceClassification"
    found = []
    if model.pooling != "cls":
        found.append(f"model.pooling={model.pooling!r} (its classifier reads the [CLS] token: it needs 'cls')")
    if getattr(model, "pooler", None) is None:  # transformers' class always applies one
        found.append("model.pooler=False (it always applies BERT's pooler, dense + tanh, to [CLS]: train with "
                     "model.pooler=true)")
    out, config = _bert_encoder(model, target, found)
    sd = model.state_dict()
    out["bert.pooler.dense.weight"], out["bert.pooler.dense.bias"] = sd["pooler.weight"], sd["pooler.bias"]
    out["classifier.weight"], out["classifier.bias"] = sd["head.weight"], sd["head.bias"]
    num_labels = out["classifier.weight"].shape[0]
    names = [str(x) for x in labels] if labels and len(labels) == num_labels else [f"LABEL_{i}" for i in range(num_labels)]
    config.update({
        "classifier_dropout": model.drop.p, "id2label": dict(enumerate(names)),
        "label2id": {n: i for i, n in enumerate(names)},
        "problem_type": "multi_label_classification" if multi_label else "single_label_classification",
    })
    return config, out


def bert_mlm_export(model: nn.Module) -> tuple[dict, dict]:
    """``(config.json dict, state dict)`` of ``BertForMaskedLM`` for a tk masked LM
    (``model.head``: BERT's prediction head, its decoder tied to the token embedding).

    Raises:
        TkError: a shape BERT cannot express, or a head activation other than the encoder's
            (transformers' head uses ``hidden_act``, tk's GELU).
    """
    target = "BertForMaskedLM"
    found = []
    if model.encoder.cfg.activation != "gelu":
        found.append(f"model.activation={model.encoder.cfg.activation!r} (its prediction head uses the encoder's "
                     f"activation, tk's head GELU: it needs 'gelu')")
    out, config = _bert_encoder(model, target, found)
    sd = state_with_norm_biases(model)
    for a, b in (("transform.dense", "head.dense"), ("transform.LayerNorm", "head.norm")):
        for kind in ("weight", "bias"):
            out[f"cls.predictions.{a}.{kind}"] = sd[f"{b}.{kind}"]
    out["cls.predictions.bias"] = sd["head.bias"]  # the decoder's weight is the tied word embedding
    config["tie_word_embeddings"] = True
    return config, out


# -- decoder-only LMs ------------------------------------------------------------------
def lm_export(model: DecoderOnlyLM, cfg: TransformerConfig, source: dict | None = None) -> tuple[dict, dict]:
    """``(config.json dict, state dict)`` of a :class:`DecoderOnlyLM` built from ``cfg``: as the family
    of ``source`` (the ``config.json`` of the Hugging Face model the run started from, its keys
    kept, its dtype written), else ``GPT2LMHeadModel`` (learned positions) or ``LlamaForCausalLM``
    (rotary positions). The mapping is the family's one table (:mod:`tk.core.exchange.hf`).

    Raises:
        TkError: a shape the family cannot express, naming the key and value.
    """
    if source is not None:
        config, state = export_decoder(model, cfg, source["model_type"], source)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(source.get("dtype") or
                                                                                 source.get("torch_dtype")))
        if dtype is not None:  # the family's files in the dtype they came in (an import + export is exact)
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        return config, state
    if cfg.pos_encoding == "learned":
        return export_decoder(model, cfg, "gpt2")
    if cfg.pos_encoding == "rotary":
        return export_decoder(model, cfg, "llama")
    raise _refuse("model.pos_encoding", cfg.pos_encoding, "transformers causal-LM",
                  "GPT-2 needs 'learned', Llama 'rotary'")


# -- the folder ------------------------------------------------------------------------
def hf_export(task: Any, model: nn.Module) -> tuple[dict, dict]:
    """``(config.json dict, state dict)`` for the run's model, by model kind: the task's own
    ``export_hf(model)`` hook where it defines one (a plugin's opt-in, e.g. a token-classification
    head as ``BertForTokenClassification``), else a text classifier / masked LM (BERT) or a
    decoder-only LM (its family), recognised by what the model is.

    Raises:
        TkError: a model with no transformers counterpart, in one line.
    """
    hook = getattr(task, "export_hf", None)
    if callable(hook):
        return hook(model)
    classifier = all(hasattr(model, a) for a in ("pooling", "pooler", "drop"))  # the text_classification model
    if (classifier and isinstance(getattr(model, "encoder", None), TextEncoder)
            and isinstance(getattr(model, "head", None), nn.Linear)):
        return bert_export(model, getattr(task, "labels", None), bool(getattr(task, "multi_label", False)))
    if isinstance(getattr(model, "encoder", None), TextEncoder) and hasattr(getattr(model, "head", None), "decoder"):
        return bert_mlm_export(model)
    if isinstance(model, DecoderOnlyLM):
        files = getattr(task, "files", None)
        source = json.loads(files.read_text(HF_SOURCE_CONFIG)) if files is not None and files.exists(HF_SOURCE_CONFIG) else None
        return lm_export(model, task.model_cfg, source)
    article = "an" if type(model).__name__[:1] in "AEIOU" else "a"
    raise TkError(f"--format hf: task {task.name!r} has {article} {type(model).__name__}, which has no transformers "
                  f"export (text classifiers and masked LMs -> BERT, language models -> their family); a plugin "
                  f"opts in by defining Task.export_hf(model) -> (config.json dict, tensors) (docs/plugins.md); "
                  f"use --format safetensors")


def peft_export(task: Any, model: nn.Module) -> tuple[dict, dict]:
    """``(adapter_config.json, tensors)`` of a LoRA run on a Hugging Face decoder, in PEFT's format
    (:mod:`tk.core.exchange.hf.peft`), its base the run's ``model.pretrained_from``.

    Raises:
        TkError: a run without adapters or without a Hugging Face base model, in one line.
    """
    lora = getattr(task.model_cfg, "lora", None)
    if lora is None or not has_lora(model):
        raise TkError("--format peft: the run has no LoRA adapters (model.lora); export the whole model with "
                      "--format hf")
    names = task.lora_names(model)
    if not names or not task.files.exists(HF_SOURCE_CONFIG):
        raise TkError(f"--format peft: the run's model did not start from a Hugging Face model "
                      f"(model.pretrained_from), so a PEFT adapter would have no base model; export --format hf "
                      f"(merged) instead")
    source = json.loads(task.files.read_text(HF_SOURCE_CONFIG))
    record = json.loads(task.files.read_text(RECORD_FILE)) if task.files.exists(RECORD_FILE) else {}
    base = record.get("from") or task.model_cfg.pretrained_from
    family = SEQ2SEQ.get(source.get("model_type")) or family_of(source)
    return export_adapter(model, names, family, TransformerConfig.of(task.model_cfg), lora, base)


def _special_tokens(config: dict, tokenizer_json: str) -> dict[str, str]:
    """The tokenizer's special tokens under transformers' names. BERT: its [PAD]/[CLS]/...;
    a causal LM: an end-of-text token (``<|endoftext|>``, ``</s>``, ``<eos>``) as eos and bos
    (GPT-2's convention) unless a ``<s>``/``<bos>`` exists, and ``<pad>``, else eos, else
    ``<unk>`` as pad, so batched tokenization and ``generate()`` need no extra arguments."""
    present = [t["content"] for t in json.loads(tokenizer_json).get("added_tokens", [])]
    if config.get("model_type") == "bert":
        return {k: v for k, v in _SPECIALS.items() if v in present}

    def first(*names: str) -> str | None:
        return next((n for n in names if n in present), None)

    unk = first("<unk>", "[UNK]", "<|unk|>")
    eos = first("<|endoftext|>", "</s>", "<eos>", "<|eos|>")
    found = {"unk_token": unk, "eos_token": eos, "bos_token": first("<s>", "<bos>", "<|bos|>") or eos,
             "pad_token": first("<pad>", "[PAD]", "<|pad|>") or eos or unk}
    return {k: v for k, v in found.items() if v is not None}


def write_hf_folder(out: Path, config: dict, state: dict[str, Tensor], tokenizer_json: str | None,
                    max_len: int, metadata: dict[str, str] | None = None, kept: dict[str, str | bytes] | None = None
                    ) -> list[str]:
    """Write ``config.json``, ``model.safetensors`` and (given a tokenizer) ``tokenizer.json`` +
    ``tokenizer_config.json`` (a ``PreTrainedTokenizerFast``) into ``out``; a causal LM also
    gets its bos/eos/pad ids in ``config.json`` and ``generation_config.json`` (and left
    padding, which batched generation needs); returns the file names. ``kept``: the source model's
    own tokenizer and generation files (a run started from a Hugging Face model), written as they
    were instead."""
    if kept:
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        export_safetensors(state, out / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
        files = ["config.json", "model.safetensors"]
        if tokenizer_json is not None:
            (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
            files.append("tokenizer.json")
        for name, data in kept.items():
            (out / name).write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
            files.append(name)
        return files
    specials = _special_tokens(config, tokenizer_json) if tokenizer_json is not None else {}
    files = ["config.json", "model.safetensors"]
    if config.get("model_type") in ("gpt2", "llama") and tokenizer_json is not None:
        config = {k: v for k, v in config.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        ids = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}
        token_ids = {f"{k[:-len('_token')]}_token_id": ids.get(specials.get(k)) for k in ("bos_token", "eos_token",
                                                                                           "pad_token")}
        config = {**config, **token_ids}
        (out / "generation_config.json").write_text(json.dumps(token_ids, indent=2) + "\n", encoding="utf-8")
        files.append("generation_config.json")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    export_safetensors(state, out / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
    if tokenizer_json is not None:
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, **specials}
        if config.get("model_type") in ("gpt2", "llama"):
            tok_cfg["padding_side"] = "left"
        (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
        files += ["tokenizer.json", "tokenizer_config.json"]
    return files
