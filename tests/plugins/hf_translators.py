"""Tiny random Hugging Face translators saved as ``save_pretrained`` does, with their tokenizers:
Marian (two SentencePiece models + vocab.json, built here) and NLLB (M2M100 weights + a
``tokenizer.json`` with language codes). The research notes' configs: a 0.1 init std, noise on
every 1-D parameter and a non-zero ``final_logits_bias``, so that a wrong mapping shows.
transformers and sentencepiece are test-only here."""

from __future__ import annotations

import io
import json
import random
import warnings
from pathlib import Path
from typing import Any

import torch

EN = "a the man woman dog cat runs sits on in red blue big small street park with ball child two people".split()
DE = "ein eine der die das Mann Frau Hund Katze läuft sitzt auf im rot blau groß klein Straße Park mit Ball Kind zwei".split()
CODES = ("eng_Latn", "deu_Latn", "fra_Latn")
SHAPE = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256, init_std=0.1)


def sentences(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 9))) + rng.choice([".", "", "!"]) for _ in range(n)]


def parallel(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """English-like / German-like pairs (word for word, so that a fine-tune can learn them)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 8))]
        pairs.append((" ".join(EN[i] for i in idx) + ".", " ".join(DE[i] for i in idx) + "."))
    return pairs


def write_parallel(prefix: Path, pairs: list[tuple[str, str]]) -> None:
    """Multi30k's format: ``{prefix}.en`` and ``{prefix}.de``, one sentence per line."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for k, lang in enumerate(("en", "de")):
        Path(f"{prefix}.{lang}").write_text("".join(p[k] + "\n" for p in pairs), encoding="utf-8")


def _spm(lines: list[str], size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=size,
                                   model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                   num_threads=1, minloglevel=2)
    return buf.getvalue()


def _perturb(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(0.3 * torch.randn_like(model.final_logits_bias))


def save_marian(folder: Path, seed: int = 0, codes: bool = False) -> Any:
    """A tiny opus-mt-shaped Marian (swish, scaled embeddings, pad = last id = decoder start, eos 0)
    and its tokenizer files; ``codes``: a multilingual model's ``>>deu<<``/``>>fra<<`` tokens."""
    import sentencepiece as spm
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    pairs = parallel(400, seed)
    source, target = _spm([s for s, _ in pairs] + sentences(EN, 100, 1), 60), _spm([t for _, t in pairs], 70)
    vocab = {"</s>": 0, "<unk>": 1}
    for proto in (source, target):
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    for code in (">>deu<<", ">>fra<<") if codes else ():
        vocab[code] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (folder / "source.spm").write_bytes(source)
    (folder / "target.spm").write_bytes(target)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"source_lang": "en", "target_lang": "de", "model_max_length": 512, "tokenizer_class": "MarianTokenizer"}))
    V = len(vocab)
    torch.manual_seed(seed)
    config = transformers.MarianConfig(vocab_size=V, decoder_vocab_size=V, pad_token_id=V - 1,
                                       decoder_start_token_id=V - 1, eos_token_id=0, forced_eos_token_id=0,
                                       activation_function="swish", scale_embedding=True, **SHAPE)
    model = transformers.MarianMTModel(config).eval()
    _perturb(model, seed)
    model.generation_config.bad_words_ids = [[V - 1]]
    model.generation_config.num_beams = 4
    model.generation_config.max_length = 64
    model.save_pretrained(folder)
    return model


def marian_tokenizer(folder: Path) -> Any:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sacremoses is missing: unused for tokenizing
        return transformers.MarianTokenizer.from_pretrained(str(folder))


def save_nllb(folder: Path, seed: int = 0) -> Any:
    """A tiny NLLB (M2M100 weights: pre-norm, ReLU, offset pad-aware sinusoids) and a fast tokenizer
    whose language codes are special tokens, as NLLB-200 ships it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    pairs = parallel(400, seed)
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok.train_from_iterator([s for p in pairs for s in p], trainers.UnigramTrainer(
        vocab_size=150, special_tokens=specials, unk_token="<unk>"))
    fast = transformers.NllbTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                          unk_token="<unk>", src_lang=CODES[0], tgt_lang=CODES[1],
                                          extra_special_tokens=list(CODES))
    fast.save_pretrained(folder)
    V = len(fast)
    torch.manual_seed(seed)
    config = transformers.M2M100Config(vocab_size=V, pad_token_id=1, eos_token_id=2, bos_token_id=0,
                                       decoder_start_token_id=2, **SHAPE)
    model = transformers.M2M100ForConditionalGeneration(config).eval()
    _perturb(model, seed)
    model.generation_config.max_length = 64
    model.save_pretrained(folder)
    return model, fast
