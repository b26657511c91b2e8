"""``tk predict`` for the masked LM: each ``[MASK]`` of a text filled with its top-k tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tk.core.text import TextTokenizer
from tk.plugins.mlm.data import MASK


@dataclass
class PredictConfig:
    """The recipe's ``predict:`` section (used by ``tk predict`` only)."""

    top_k: int = 5  # tokens listed per [MASK], most likely first (capped at the vocabulary size)

    def check(self) -> list[str]:
        """Range checks; one message per broken rule, naming the ``predict.*`` key."""
        return [] if self.top_k >= 1 else [f"predict.top_k ({self.top_k}) must be >= 1"]


@torch.no_grad()
def fill_masks(model: nn.Module, tokenizer: TextTokenizer, text: str, max_len: int, top_k: int) -> dict[str, Any]:
    """Fill each ``[MASK]`` of ``text``.

    Returns:
        ``{"filled": text with each [MASK] replaced by its most likely token, "masks": [{"tokens":
        [top_k tokens], "probs": [their probabilities]}, ... one per [MASK], left to right]}``,
        or ``{"error": ...}`` for a text without ``[MASK]`` or longer than ``max_len`` tokens.
    """
    mask_id = tokenizer.token_id(MASK)
    ids = tokenizer.encode(text)  # [CLS] ... [SEP]; "[MASK]" is matched as a special token
    where = [i for i, t in enumerate(ids) if t == mask_id]
    if not where:
        return {"error": f"no {MASK} in the text; write {MASK} where a token should be predicted, "
                         f"e.g. 'the {MASK} sat on the mat'"}
    if len(ids) > max_len:
        return {"error": f"{len(ids)} tokens, more than data.max_len ({max_len}) the model was trained on; "
                         f"shorten the text"}
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    positions = tokens.eq(mask_id)
    probs = model(tokens, None, positions).float().softmax(-1)  # (M, V)
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    masks = [{"tokens": [tokenizer.decode([i], skip_special_tokens=False) for i in idx],
              "probs": [round(p, 4) for p in ps]}
             for idx, ps in zip(top.indices.tolist(), top.values.tolist())]
    filled = fill_text(text, [m["tokens"][0] for m in masks])
    if filled is None:  # not one [MASK] string per masked position: the tokenizer's own decoding
        best = dict(zip(where, top.indices[:, 0].tolist()))
        filled = tokenizer.decode([best.get(i, t) for i, t in enumerate(ids)])
    return {"filled": filled, "masks": masks}


def fill_text(text: str, tokens: list[str]) -> str | None:
    """``text`` with its ``[MASK]``s replaced by ``tokens`` in order; everything else as the user
    wrote it (case, unknown words, spacing). A word piece (``##ing``) joins without its mark.
    None when the text does not hold one ``[MASK]`` per token."""
    parts = text.split(MASK)
    if len(parts) != len(tokens) + 1:
        return None
    pieces = [t[2:] if t.startswith("##") else t for t in tokens]
    return parts[0] + "".join(p + rest for p, rest in zip(pieces, parts[1:]))
