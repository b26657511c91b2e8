"""Language-model metrics: perplexity plus bits per token, per character and per UTF-8 byte."""

from __future__ import annotations

import math
from collections.abc import Callable

from tk.core.media import Text
from tk.core.step import EvalContext
from tk.core.text import Perplexity


class LMMetrics(Perplexity):
    """Bits per token, perplexity (= exp(nats per token)) and, for char level, bits per char;
    with ``bytes_per_token`` (BPE), bits per UTF-8 byte of the evaluated text.

    Args:
        per_char: one token is one character (report ``bits_per_char``).
        bytes_per_token: UTF-8 bytes per evaluated token (report ``bits_per_byte``); None = not.
        samples: the evaluation's generated samples, handed to the loggers as media.
    """

    def __init__(self, per_char: bool, bytes_per_token: float | None = None,
                 samples: Callable[[EvalContext], str | None] | None = None) -> None:
        super().__init__("perplexity")
        self.per_char, self.bytes_per_token, self._samples = per_char, bytes_per_token, samples

    def keys(self) -> list[str]:
        return (["bits_per_token", "perplexity"] + (["bits_per_char"] if self.per_char else [])
                + (["bits_per_byte"] if self.bytes_per_token else []))

    def compute(self) -> dict[str, float]:
        bits = self.mean_loss() / math.log(2)
        out = {"bits_per_token": bits, **super().compute()}
        if self.per_char:  # one token is one character
            out["bits_per_char"] = bits
        if self.bytes_per_token:
            out["bits_per_byte"] = bits / self.bytes_per_token
        return out

    def media(self, ctx: EvalContext) -> list[Text]:
        """This evaluation's samples (also in ``samples/step_N.txt``) as one text item."""
        text = self._samples(ctx) if self._samples is not None else None
        return [Text(f"{ctx.key_prefix}/samples", text)] if text else []
