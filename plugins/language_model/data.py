"""Token blocks of a contiguous token array: random ones for training, sequential ones for evaluation."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from tk.core.errors import TkError


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (the on-disk token array)."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


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
