"""Streaming decoded text while ``generate`` runs: one token at a time, as text pieces."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

REPLACEMENT = "\ufffd"  # what a byte-level decoder shows for an incomplete UTF-8 character


class TextStream:
    """An ``on_step`` callback for :func:`tk.core.nn.generation.generate` (batch of one):
    decodes the tokens so far and hands the new text to ``emit`` (``tk generate``, ``tk chat``).

    Decoding the whole prefix each step (not token by token) keeps BPE merges and
    multi-byte characters right; text ending in an incomplete character is held back
    until the next token completes it. A ``decode`` that strips whitespace still emits only
    prefixes of the final text.
    """

    def __init__(self, decode: Callable[[list[int]], str], emit: Callable[[str], None],
                 eos_id: int | list[int] | None) -> None:
        self.decode, self.emit = decode, emit
        self.stops = set(eos_id) if isinstance(eos_id, list) else {eos_id}  # every token that ends the text
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted
        self.ended = False

    def __call__(self, step: int, tokens: Tensor) -> None:
        if self.ended:
            return
        tok = int(tokens[0])  # one host sync per step, only when streaming
        self.ids.append(tok)
        self.ended = tok in self.stops
        text = self.decode(self.ids)
        if not text.endswith(REPLACEMENT):
            self._send(text)

    def finish(self, text: str) -> None:
        """Emit whatever of the final ``text`` was not emitted yet."""
        self._send(text)

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.emit(text[self.sent:])
            self.sent = len(text)
