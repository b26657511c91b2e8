"""Tiny random Hugging Face decoders of every family tk loads, saved as ``save_pretrained`` does
(the research notes' configs: a 0.15 init and noise on every 1-D parameter, so that a dropped,
swapped or mis-scaled tensor shows well above 1e-4), with a small BPE tokenizer. transformers
is a test-only dependency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.15)
# family -> (config class name, kwargs beyond COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.15)),
    "llama2": ("LlamaConfig", dict(COMMON, num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(COMMON, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "smollm2": ("LlamaConfig", dict(COMMON, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
                                    tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(COMMON, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                                  tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(COMMON, num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                                  tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(COMMON, num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", dict(COMMON, num_key_value_heads=1, head_dim=32, hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(COMMON, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                                    sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "phi3": ("Phi3Config", dict(COMMON, num_key_value_heads=4, sliding_window=None, tie_word_embeddings=False,
                                pad_token_id=0)),
    "llama_linear": ("LlamaConfig", dict(COMMON, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
                                         rope_scaling={"rope_type": "linear", "factor": 4.0})),
}
TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. to be or not to be, that is "
        "the question. all that glitters is not gold. the early bird catches the worm.\n") * 20


def tokenizer(folder: Path, bos: bool = False) -> Any:
    """A byte-level BPE of ~300 ids with <|endoftext|>/<|im_start|>/<|im_end|>, saved by transformers
    (``tokenizer.json`` + ``tokenizer_config.json``); ``bos`` adds a BOS template (Llama 3 style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                           special_tokens=[("<|begin_of_text|>", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|begin_of_text|>" if bos else None)
    fast.save_pretrained(folder)
    return fast


def save_tiny(family: str, folder: Path, seed: int = 0, max_shard_size: str | None = None,
              dtype: torch.dtype = torch.float32, eos: Any = None) -> Any:
    """Build, perturb and save the tiny ``family`` model (and its tokenizer) in ``folder``; returns the HF model."""
    import transformers

    name, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = None if eos is None else (eos if isinstance(eos, int) else eos[0])
    model.generation_config.bos_token_id = None
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer(folder, bos=family.startswith("llama3"))
    return model
