"""Streaming a reply while ``generate`` runs: one token at a time, as text pieces."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

REPLACEMENT = "\ufffd"  # what a byte-level decoder shows for an incomplete UTF-8 character


class ReplyStream:
    """An ``on_step`` callback for :func:`tk.core.nn.generation.generate` (batch of one): decodes
    the reply so far and hands the new text to ``emit``.

    Decoding the whole reply each step (not token by token) keeps BPE merges and multi-byte
    characters right; text ending in an incomplete character waits for the next token, and
    ``text_of`` strips whitespace, so what is emitted is always a prefix of the final reply.
    """

    def __init__(self, text_of: Callable[[list[int]], str], emit: Callable[[str], None], stop_ids: list[int]) -> None:
        self.text_of, self.emit, self.stops = text_of, emit, set(stop_ids)
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted
        self.ended = False

    def __call__(self, step: int, tokens: Tensor) -> None:
        if self.ended:
            return
        token = int(tokens[0])  # one host sync per step, only when streaming
        self.ids.append(token)
        self.ended = token in self.stops
        text = self.text_of(self.ids)
        if not text.endswith(REPLACEMENT):
            self._send(text)

    def finish(self, text: str) -> None:
        """Emit whatever of the final ``text`` was not emitted yet."""
        self._send(text)

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.emit(text[self.sent:])
            self.sent = len(text)

