"""Chat templates: a model's jinja ``chat_template`` rendered as transformers renders it (a sandboxed
jinja2 environment with its globals and ``{% generation %}`` spans), encoded in one pass without
adding special tokens (the template writes them: exactly one BOS), and the mask of the tokens a
model should learn: its assistant turns, end-of-turn token included, for ANY template: the
``{% generation %}`` spans where the template has them, else the text each assistant message adds
to the rendered conversation before it (its prefix rendered with the generation prompt).

The template comes from a model folder (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``: a string, or a list of named ones whose ``default`` is used) or from a recipe.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from tk.core.errors import TkError

TEMPLATE_FILE = "chat_template.jinja"
MASKS = ("assistant", "last", "all")  # which tokens are targets: every assistant turn, the last one, all
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# a tiny default (ChatML) for models that ship none, e.g. tk's own runs
DEFAULT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
                    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _content(token: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, Mapping) else token


def read_chat_template(folder: str | Path) -> tuple[str | None, dict[str, str]]:
    """The folder's chat template (None where it has none) and its special tokens by role
    (``bos_token``, ``eos_token``, ...: what templates read).

    Raises:
        TkError: an unreadable ``tokenizer_config.json``, or named templates without ``default``.
    """
    folder = Path(folder)
    config: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except ValueError as e:
            raise TkError(f"{folder / 'tokenizer_config.json'} is not valid JSON ({e})") from e
    specials = {k: _content(config[k]) for k in SPECIAL_KEYS if _content(config.get(k)) is not None}
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), specials
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates (tool use, RAG, ...): the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" not in named:
            raise TkError(f"{folder / 'tokenizer_config.json'}: its chat templates are named {sorted(named)} and none "
                          f"is 'default'; give the template to use in the recipe")
        template = named["default"]
    return template, specials


def _environment() -> Any:
    """transformers' environment: sandboxed, trim/lstrip blocks, loop controls, ``{% generation %}``,
    ``raise_exception``, ``strftime_now`` and a ``tojson`` that does not HTML-escape."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(Extension):
        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("spans", default=None)
            environment.extend(track_spans=self.track)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            text = caller()
            state = self.tracking.get()
            if state is not None:
                blocks, spans = state
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            token = self.tracking.set((blocks, spans))
            try:
                yield
            finally:
                self.tracking.reset(token)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template with the special tokens it reads.

    Raises (constructor):
        TkError: a template jinja cannot compile, with its message.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import jinja2

        self.source, self.special_tokens = source, dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise TkError(f"chat template: jinja cannot compile it: {e}") from e
        self.has_generation_tags = bool(_GENERATION_TAG.search(source))

    @classmethod
    def from_folder(cls, folder: str | Path, default: str | None = DEFAULT_TEMPLATE) -> ChatTemplate:
        """The folder's template, else ``default`` (None: refuse).

        Raises:
            TkError: no template and no default.
        """
        source, specials = read_chat_template(folder)
        if source is None:
            if default is None:
                raise TkError(f"{folder} has no chat template ({TEMPLATE_FILE} or tokenizer_config.json's "
                              f"chat_template); give one in the recipe")
            source = default
        return cls(source, specials)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its ``{% generation %}`` blocks.

        Raises:
            TkError: the template raised (``raise_exception``) or failed, with its message.
        """
        import jinja2

        values = {**self.special_tokens, **kwargs, "messages": [dict(m) for m in messages],
                  "add_generation_prompt": add_generation_prompt}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with self._template.environment.track_spans(blocks, spans):
                for block in self._template.generate(**values):
                    blocks.append(block)
        except jinja2.TemplateError as e:
            raise TkError(f"chat template: {e}") from e
        return "".join(blocks), spans

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant message: the
        ``{% generation %}`` blocks, or for a template without them the text each assistant
        message adds after its prefix rendered with the generation prompt.

        Raises:
            TkError: a template whose renderings are not prefixes of each other (its assistant
                turns cannot be found that way), named.
        """
        text, spans = self.render(messages, **kwargs)
        if self.has_generation_tags:
            return text, spans
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, _ = self.render(messages[:k], add_generation_prompt=True, **kwargs)
            upto, _ = self.render(messages[: k + 1], **kwargs)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise TkError(f"chat template: rendering message {k} changes the text before it (the template is "
                              f"not prefix-stable), so its assistant turns cannot be found; add {{% generation %}} "
                              f"markers around the assistant content, or train on all tokens")
            spans.append((len(before), len(upto)))
        return text, spans


def encode_chat(tokenizer: Any, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], mask: str = "assistant",
                add_generation_prompt: bool = False, **kwargs: Any) -> tuple[list[int], list[int]]:
    """Token ids of a conversation (as transformers' ``apply_chat_template(tokenize=True)``: the whole
    rendering encoded once, no special tokens added) and its target mask (1 = learn this token).

    Args:
        tokenizer: a :class:`~tk.core.text.tokenizer.TextTokenizer`.
        mask: "assistant" (every assistant turn), "last" (the last one), "all".

    Raises:
        TkError: an unknown ``mask``, or what :meth:`ChatTemplate.assistant_spans` raises.
    """
    if mask not in MASKS:
        raise TkError(f"mask ({mask!r}) must be one of {', '.join(MASKS)}")
    if mask == "all" or add_generation_prompt:
        text, spans = template.render(messages, add_generation_prompt, **kwargs)
        encoding = tokenizer.tok.encode(text, add_special_tokens=False)
        return encoding.ids, [int(mask == "all")] * len(encoding.ids)
    text, spans = template.assistant_spans(messages, **kwargs)
    if mask == "last":
        spans = spans[-1:]
    encoding = tokenizer.tok.encode(text, add_special_tokens=False)
    return encoding.ids, span_mask(encoding.offsets, spans)


def span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span (spans and offsets in order), as
    transformers' ``return_assistant_tokens_mask``."""
    out, j = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        if end > spans[j][0]:
            out[i] = 1
    return out
