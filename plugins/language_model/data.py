"""The ``data:`` and ``tokenizer:`` sections, tokenising the corpus into one token array, and
the token blocks read from it (random ones for training, sequential ones for evaluation)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from tk.core.errors import TkError
from tk.core.text import TextTokenizer, iter_column
from tk.core.text import TokenizerConfig as SharedTokenizerConfig
from tk.core.text.tokenizer import Kind

UNK = "<unk>"  # char kind: id 0; any character not seen in the training split maps to it


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "text", "hf"] = "synthetic"  # synthetic grammar; text: data.path; hf: data.hf_name
    path: str | None = None  # source=text: a UTF-8 file, a folder of files or a glob (joined in sorted order)
    hf_name: str | None = None  # source=hf: a datasets hub name, or a folder written by save_to_disk
    hf_config: str | None = None  # source=hf: the dataset's configuration name (datasets.load_dataset's name)
    hf_split: str = "train"  # source=hf: the one split read (val = its last val_fraction of tokens)
    streaming: bool = False  # source=hf: read the documents lazily (every pass re-reads them) instead of downloading
    text_column: str = "text"  # source=hf: the column holding the documents
    doc_separator: str = "\n\n"  # source=hf: text appended to every document before they are joined
    token_cache: bool = True  # source=hf: keep the token file in $TK_CACHE/tokens (default ~/.cache/tk), reused by later runs and continued after a kill
    num_sentences: int = 20000  # synthetic: sentences generated (about 25 characters each)
    seed: int = 0  # synthetic: seed of the corpus (independent of train.seed)
    block_size: int = 64  # context length T in tokens (a training block is T + 1 tokens)
    val_fraction: float = 0.1  # the last fraction of the token stream is the validation split
    eval_blocks: int = 200  # validation blocks per evaluation (sequential, non-overlapping)
    num_samples: int = 3  # continuations written to samples/step_N.txt at each evaluation; 0 = none
    sample_prompt_len: int = 16  # tokens of a val block that each sample continues


@dataclass
class TokenizerConfig(SharedTokenizerConfig):
    """The ``tokenizer:`` section: trained on the train split unless ``path`` is given."""

    kind: Kind = "char"  # char: one id per character seen (others -> <unk>, id 0); bpe: byte-level BPE
    vocab_size: int = 4096  # bpe/wordpiece/unigram: vocabulary size trained on the train split
    min_frequency: int = 0  # bpe/wordpiece: occurrences a merge needs (0: any pair, tokenizers' default)


def load_saved_tokenizer(saved: str) -> TextTokenizer:
    """The run's tokenizer.json; a run written before ``tk.core.text`` holds
    ``{"kind": "char", "chars": [...]}``, rebuilt here with the same ids (UNK 0, then the
    sorted characters)."""
    old = json.loads(saved)
    if old.get("kind") == "char" and "chars" in old:
        return TextTokenizer.train(["".join(old["chars"])], TokenizerConfig(kind="char"), [UNK])
    return TextTokenizer.from_str(saved)


def decode(tokenizer: TextTokenizer, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """The text of ``ids``: char runs show unknown characters as ``<unk>``; other kinds leave
    special tokens out (e.g. GPT-2's ``<|endoftext|>``)."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids  # a tensor or numpy array of ids
    return tokenizer.decode(ids, skip_special_tokens=tokenizer.kind != "char")


def decode_after(tokenizer: TextTokenizer, context: Sequence[int], ids: Sequence[int] | torch.Tensor) -> str:
    """The text ``ids`` add after ``context``: decoded together, so that the space a WordPiece
    or Unigram decoder puts between words is kept at the seam (decoding ``ids`` alone drops a
    leading space: "the cat" + "sat" would print as "the catsat")."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    head, full = decode(tokenizer, list(context)), decode(tokenizer, [*context, *ids])
    return full[len(head):] if full.startswith(head) else decode(tokenizer, ids)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (the on-disk token array)."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


def empty_corpus(d: DataConfig) -> TkError:
    """The error of a corpus without a single token."""
    return TkError(f"data: the corpus ({d.path or d.hf_name or 'synthetic'}) is empty (0 tokens); the run needs "
                   f"at least data.block_size + 1 = {d.block_size + 1} tokens in each split")


def train_documents(ds: Any, d: DataConfig) -> Iterator[str]:
    """The documents (each with its separator) up to the character where the validation part
    starts, the last one cut there: what the tokenizer may see. Counting the characters
    first is one more pass over the column, not a copy of it."""
    sep = d.doc_separator
    total = sum(len(t) + len(sep) for texts in iter_column(ds, d.text_column) for t in texts)
    left = total - int(total * d.val_fraction)
    for texts in iter_column(ds, d.text_column):
        for t in texts:
            if left <= 0:
                return
            doc = (t + sep)[:left]
            left -= len(doc)
            yield doc


def corpus_identity(ds: Any, d: DataConfig) -> dict[str, Any]:
    """What names the documents of a ``datasets`` corpus in the token cache's key: the name,
    config, split and column, plus the dataset's fingerprint where it has one (a local folder
    that changes gets a new key); a streamed hub dataset is named by its id alone."""
    name = d.hf_name or ""
    folder = Path(name).expanduser()
    return {"hf_name": str(folder.resolve()) if folder.exists() else name, "hf_config": d.hf_config,
            "hf_split": d.hf_split, "text_column": d.text_column, "fingerprint": getattr(ds, "_fingerprint", None)}


def tokenise_documents(ds: Any, tokenizer: TextTokenizer, d: DataConfig, path: Path | None
                       ) -> tuple[np.ndarray, int]:
    """The documents of a ``datasets`` corpus, each followed by ``data.doc_separator``,
    tokenised into ``path`` (see :func:`write_tokens`).

    Raises:
        TkError: the corpus has no token.
    """
    tokens, num_chars = write_tokens(([t + d.doc_separator for t in texts] for texts in iter_column(ds, d.text_column)),
                                     tokenizer, path)
    if len(tokens) == 0:
        raise empty_corpus(d)
    return tokens, num_chars


def tokenise_pieces(pieces: Iterable[str], tokenizer: TextTokenizer, path: Path | None, batch: int = 8
                    ) -> tuple[np.ndarray, int]:
    """A text file's pieces (``tk.core.text.cut_pieces``: their ids are the whole text's ids)
    tokenised ``batch`` at a time, in parallel, into ``path`` (see :func:`write_tokens`)."""
    pieces = iter(pieces)
    return write_tokens(iter(lambda: list(islice(pieces, batch)), []), tokenizer, path, add_special_tokens=False)


def write_tokens(batches: Iterable[list[str]], tokenizer: TextTokenizer, path: Path | None,
                 add_special_tokens: bool = True) -> tuple[np.ndarray, int]:
    """The texts of ``batches`` tokenised in order into ``path`` (memory-mapped afterwards; in
    memory when None): the text never has to fit in memory. A partial file is removed on any
    error or Ctrl-C. Returns the tokens and the number of characters."""
    dtype = token_dtype(tokenizer.vocab_size)
    chunks, num_chars = [], 0
    part = None if path is None else path.with_suffix(".part")
    if part is not None:
        part.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(part, "wb") if part is not None else nullcontext() as out:
            for texts in batches:
                ids = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens).ids
                ids = np.concatenate([np.asarray(e, dtype=dtype) for e in ids]) if ids else np.zeros(0, dtype)
                num_chars += sum(map(len, texts))
                chunks.append(ids) if out is None else out.write(ids.tobytes())
    except BaseException:  # an error or Ctrl-C: no half-written token file is left in the task files
        if part is not None:
            part.unlink(missing_ok=True)
        raise
    if part is None:
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype), num_chars
    if part.stat().st_size == 0:  # an empty corpus leaves no token file (the caller names the error)
        part.unlink()
        return np.zeros(0, dtype), num_chars
    part.replace(path)
    return np.memmap(path, dtype=dtype, mode="r"), num_chars


def split_tokens(tokens: np.ndarray, val_fraction: float, block_size: int) -> dict[str, np.ndarray]:
    """Train = the first ``1 - val_fraction`` of the tokens, val = the rest (by position, as nanoGPT).

    Raises:
        TkError: when either split has fewer than ``block_size + 1`` tokens.
    """
    n_val = int(len(tokens) * val_fraction)
    splits = {"train": tokens[: len(tokens) - n_val], "val": tokens[len(tokens) - n_val:]}
    for name, part in splits.items():
        if len(part) < block_size + 1:
            raise TkError(f"data: the {name} split has {len(part)} tokens (corpus: {len(tokens)}, "
                          f"data.val_fraction={val_fraction}) but one block needs data.block_size + 1 = "
                          f"{block_size + 1}; use a longer corpus or a smaller data.block_size")
    return splits


class BlockDataset(Dataset):
    """Item ``i``: ``tokens[i * stride : i * stride + block_size + 1]`` as an int64 tensor.

    Training uses stride 1 (item = start offset, drawn by ``RandomBlockSampler``); evaluation
    uses stride ``block_size`` and the first ``num_blocks`` blocks (sequential, fixed).
    """

    def __init__(self, tokens: np.ndarray, block_size: int, stride: int = 1, num_blocks: int | None = None) -> None:
        self.tokens, self.block_size, self.stride = tokens, block_size, stride
        available = (len(tokens) - block_size - 1) // stride + 1
        self.num_blocks = available if num_blocks is None else min(num_blocks, available)

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.stride
        return torch.from_numpy(self.tokens[start: start + self.block_size + 1].astype(np.int64))


def collate_blocks(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Blocks (B, T + 1) -> ``{"tokens": (B, T) inputs, "targets": (B, T) next tokens}``."""
    x = torch.stack(samples)
    return {"tokens": x[:, :-1], "targets": x[:, 1:]}
