"""The ``data:`` section, the formats people keep instructions and chats in (prompt/completion,
Alpaca, ``messages``, ShareGPT) turned into messages, the generated offline default, and the
encoded examples: token ids with the targets the loss reads (-100 where nothing is learned)."""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from tk.core.errors import TkError

IGNORE = -100  # target of a token the loss skips
FORMATS = ("auto", "prompt_completion", "alpaca", "messages", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "system": "system", "bing": "assistant", "bard": "assistant"}
WORDS = ("red", "green", "blue", "cat", "dog", "bird", "one", "two", "three", "sun", "moon", "star", "tree", "river",
         "stone", "fire")


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["synthetic", "files", "hf"] = "synthetic"  # synthetic: generated instructions; files: train_file/val_file; hf: hf_name
    train_file: str | None = None  # source=files: .jsonl, .json, .csv or .parquet of examples
    val_file: str | None = None  # source=files: held-out examples; None = the last val_fraction of train_file
    hf_name: str | None = None  # source=hf: a datasets hub name or a save_to_disk folder
    hf_config: str | None = None  # source=hf: the dataset's configuration name
    hf_split: str = "train"  # source=hf: the split trained on
    val_split: str | None = None  # source=hf: the validation split; None = the last val_fraction of hf_split
    val_fraction: float = 0.05  # held out from the training examples when no validation set is given
    format: Literal["auto", "prompt_completion", "alpaca", "messages", "sharegpt"] = "auto"  # how a row holds its conversation; auto: from its columns
    columns: dict[str, str] = field(default_factory=dict)  # renames {column in the file: the format's name}, e.g. {question: prompt, answer: completion}
    system_prompt: str | None = None  # a system message put first in every conversation that has none
    max_len: int = 512  # tokens per example (and per packed row); longer ones are truncated (counted in train.log)
    truncate: bool = True  # false: an example longer than max_len is an error naming it (instead of cut and counted)
    packing: bool = False  # several examples per row of max_len tokens, each attending only to itself (block-causal mask, positions restarting): the same loss as alone, less padding
    mask: Literal["assistant", "last", "all"] = "assistant"  # the tokens learned: every assistant turn (end-of-turn included), the last one, or all
    chat_template: str | None = None  # a jinja chat template or a .jinja file; None = the model's own (tk's ChatML for a model without one)
    num_train: int = 2000  # synthetic: training examples
    num_val: int = 200  # synthetic: validation examples
    seed: int = 0  # synthetic: seed of the generated examples


def check_data(d: DataConfig) -> list[str]:
    problems = []
    if d.source == "files" and not d.train_file:
        problems.append("data.train_file: source=files needs a .jsonl/.json/.csv/.parquet file of examples")
    if d.source == "hf" and not d.hf_name:
        problems.append("data.hf_name: source=hf needs a datasets name or a save_to_disk folder")
    if not 0.0 < d.val_fraction < 1.0:
        problems.append(f"data.val_fraction ({d.val_fraction}) must be in (0, 1)")
    if d.max_len < 2:
        problems.append(f"data.max_len ({d.max_len}) must be >= 2")
    if d.chat_template and d.chat_template.endswith(".jinja") and not Path(d.chat_template).expanduser().is_file():
        problems.append(f"data.chat_template: {d.chat_template} does not exist; give a .jinja file or the template text")
    if d.format not in FORMATS:
        problems.append(f"data.format ({d.format!r}) must be one of {', '.join(FORMATS)}")
    return problems


# -- rows -> messages ------------------------------------------------------------------
def detect_format(row: Mapping[str, Any]) -> str:
    """The format of a row, from its columns.

    Raises:
        TkError: columns that fit no format, named.
    """
    keys = set(row)
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    raise TkError(f"data.format: a row has the columns {sorted(keys)}, which fit no format (messages; conversations "
                  f"(ShareGPT); instruction + output (Alpaca); prompt + completion); rename them with data.columns "
                  f"or set data.format")


def to_messages(row: Mapping[str, Any], fmt: str, system: str | None) -> list[dict[str, str]]:
    """The conversation a row holds, as ``{"role", "content"}`` messages (a system prompt first
    where the row has none)."""
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "messages":
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    elif fmt == "sharegpt":
        messages = [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in row["conversations"]]
    elif fmt == "alpaca":
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    else:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def renamed(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str]) -> Iterable[dict[str, Any]]:
    for row in rows:
        yield {columns.get(k, k): v for k, v in row.items()}


def synthetic_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Instructions a small model can learn: reverse, sort or repeat a few words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        kind = rng.choice(("reverse", "sort", "repeat"))
        answer = {"reverse": words[::-1], "sort": sorted(words), "repeat": words}[kind]
        rows.append({"prompt": f"{kind}: {' '.join(words)}", "completion": " ".join(answer)})
    return rows


def read_rows(path: str, key: str) -> list[dict[str, Any]]:
    """The rows of a .jsonl/.json/.csv/.parquet file (read by ``datasets``).

    Raises:
        TkError: a missing file or an unknown suffix, named.
    """
    file = Path(path).expanduser()
    kinds = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    if not file.is_file():
        raise TkError(f"{key}: {path} does not exist; give a .jsonl, .json, .csv or .parquet file of examples")
    if file.suffix not in kinds:
        raise TkError(f"{key}: {path} is a {file.suffix or 'suffix-less'} file; give .jsonl, .json, .csv or .parquet")
    import datasets  # lazy: the synthetic default needs none

    try:
        return list(datasets.load_dataset(kinds[file.suffix], data_files=str(file), split="train"))
    except Exception as e:  # datasets raises many kinds for a malformed file
        raise TkError(f"{key}: cannot read {path}: {(str(e).splitlines() or [type(e).__name__])[0][:200]}") from e


# -- encoded examples --------------------------------------------------------------------
@dataclass
class Counts:
    """What encoding did to a split's examples (written to train.log)."""

    examples: int = 0
    truncated: int = 0
    dropped: int = 0  # no supervised token left (after truncation, or none to begin with)
    tokens: int = 0
    targets: int = 0

    def line(self, split: str) -> str:
        return (f"{split}: {self.examples - self.dropped} examples ({self.tokens:,} tokens, {self.targets:,} of them "
                f"targets); {self.truncated} truncated to data.max_len, {self.dropped} dropped with no target token")


def make_example(ids: Sequence[int], mask: Sequence[int], max_len: int, counts: Counts,
                 truncate: bool = True) -> tuple[list[int], list[int]] | None:
    """(inputs, targets) of one conversation: ``targets[t]`` is ``ids[t + 1]`` where that token is
    learned, else -100; None (counted) where no target is left.

    Raises:
        TkError: an example over ``max_len`` when ``truncate`` is off.
    """
    counts.examples += 1
    if len(ids) > max_len + 1 and not truncate:
        raise TkError(f"data: example {counts.examples} has {len(ids) - 1} tokens, more than data.max_len ({max_len}) "
                      f"and data.truncate is false; raise data.max_len or set data.truncate: true (cut and counted)")
    if len(ids) > max_len + 1:
        ids, mask = ids[: max_len + 1], mask[: max_len + 1]
        counts.truncated += 1
    targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
    if not any(t != IGNORE for t in targets):
        counts.dropped += 1
        return None
    counts.tokens += len(ids) - 1
    counts.targets += sum(t != IGNORE for t in targets)
    return list(ids[:-1]), targets


Example = tuple[list[int], list[int]]  # (inputs, targets)


class ExampleDataset(Dataset):
    """Encoded examples, (inputs, targets) pairs of token ids, or packed rows (lists of them)."""

    def __init__(self, examples: list[Example] | list[list[Example]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example | list[Example]:
        return self.examples[i]


def pack_examples(examples: Sequence[Example], row_len: int) -> list[list[Example]]:
    """Examples grouped into rows of at most ``row_len`` tokens by best-fit decreasing (each, longest
    first, into the fullest row it still fits; TRL's and torchtune's strategy): few rows, little
    padding, and the same rows on every call (resume packs exactly as the run did)."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i][0]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), ascending
    for i in order:
        n = len(examples[i][0])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
        else:
            room, r = row_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return [[examples[i] for i in sorted(row)] for row in rows]


def pack_splits(splits: Mapping[str, list[Example]], row_len: int | None, batch_size: int, seed: int
                ) -> tuple[dict[str, list[list[Example]]], str]:
    """Every split packed into rows of ``row_len`` tokens (None: not packed), and a line saying how
    much of the training batches is padding, packed and padded."""
    train = splits["train"]
    padded = padding_share([len(x) for x, _ in train], batch_size, seed)
    if row_len is None:
        return {}, (f"padded batches of {batch_size} examples are {100 * padded:.1f}% padding (one shuffled epoch; "
                    f"data.packing: true puts several examples in each row of data.max_len tokens)")
    packed = {split: pack_examples(examples, row_len) for split, examples in splits.items()}
    rows = packed["train"]
    share = padding_share([sum(len(x) for x, _ in r) for r in rows], batch_size, seed)
    return packed, (f"packing: {len(train)} train examples in {len(rows)} rows of <= {row_len} tokens "
                    f"({len(train) / len(rows):.1f} per row); batches of {batch_size} rows are {100 * share:.1f}% "
                    f"padding (padded batches of {batch_size} examples would be {100 * padded:.1f}%)")


def padding_share(lengths: Sequence[int], batch_size: int, seed: int = 0) -> float:
    """The share of padding in right-padded batches of ``batch_size`` drawn in a shuffled order."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    padded = real = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        padded += max(batch) * len(batch)
        real += sum(batch)
    return 1.0 - real / padded if padded else 0.0


def collate_examples(samples: list[Example] | list[list[Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``tokens`` (B, T) and ``targets`` (B, T) (-100 at padding): under causal
    attention the padding after a row's tokens changes none of its logits. Packed rows (lists of
    examples) also get ``segments`` (B, T): k at the row's k-th example, 0 at padding."""
    packed = bool(samples) and isinstance(samples[0], list)
    rows = samples if packed else [[s] for s in samples]
    T = max(sum(len(x) for x, _ in row) for row in rows)
    tokens = torch.full((len(rows), T), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    segments = torch.zeros((len(rows), T), dtype=torch.long)
    for i, row in enumerate(rows):
        start = 0
        for k, (x, y) in enumerate(row, start=1):
            tokens[i, start : start + len(x)] = torch.tensor(x)
            targets[i, start : start + len(y)] = torch.tensor(y)
            segments[i, start : start + len(x)] = k
            start += len(x)
    batch = {"tokens": tokens, "targets": targets}
    return {**batch, "segments": segments} if packed else batch
