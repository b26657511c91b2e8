"""``tk chat RUN``: a conversation in the terminal with a trained sft run, rendered with the chat
template the run was trained with."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import click
from torch import nn

from tk.core.engine.inference import load_run
from tk.core.errors import TkError
from tk.core.recipe import read_recipe
from tk.core.text.reader import stream_lines

RESET, EXIT = "/reset", "/exit"  # the chat's commands, typed alone on a line


class Conversation:
    """The messages so far (the system message first, if any) and the model that answers."""

    def __init__(self, task: Any, model: nn.Module, system: str | None) -> None:
        self.task, self.model, self.system = task, model, system
        self.messages: list[dict[str, str]] = []
        self.reset()

    @property
    def turns(self) -> int:
        """The user's messages kept so far."""
        return sum(m["role"] == "user" for m in self.messages)

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.messages = [] if not self.system else [{"role": "system", "content": self.system}]

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """The assistant's reply to the user's ``text`` (streamed to ``on_text``), both kept in the
        history; a turn that fails (too long, interrupted) is not kept."""
        self.messages.append({"role": "user", "content": text})
        try:
            reply = self.task.reply(self.model, self.messages, on_text=on_text)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": reply})
        return reply


@click.command("chat")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("overrides", nargs=-1, metavar="[section.key=value]...")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
@click.option("--weights", default=None, metavar="FILE",
              help="A .safetensors file to load instead of the checkpoint's weights (the run's config and template).")
@click.option("--system", default=None, metavar="TEXT",
              help="A system message first in the conversation  [default: the run's data.system_prompt]")
def chat(run_dir: str, overrides: tuple[str, ...], checkpoint: str, weights: str | None, system: str | None) -> None:
    """Chat with a trained sft run, in the chat template it was trained with.

    \b
    In a terminal the reply is printed as it is generated; /reset forgets the conversation
    (the system message stays), /exit or Ctrl-D ends it. Piped, each input line is one user
    message and each reply one output line (a line break inside a reply is written \\n):
      printf 'hi\\nreverse: red cat\\n' | tk chat runs/sft_synthetic
    Settings are keys of the run's `generate:` section, set as overrides:
      tk chat runs/sft_synthetic generate.max_len=64 generate.strategy=sample generate.temperature=0.7
    """
    _check_task(Path(run_dir))
    task, model = load_run(run_dir, checkpoint, list(overrides), weights=weights)
    if task.name != "sft":
        raise TkError(f"{run_dir} is a {task.name!r} run; tk chat needs an sft run")
    conversation = Conversation(task, model, task.data.system_prompt if system is None else system)
    if sys.stdin.isatty():
        _interactive(conversation, run_dir)
    else:
        _piped(conversation, sys.stdin)


def _check_task(run_dir: Path) -> None:
    """Refuse another task's run before its weights are read."""
    config = run_dir / "config.yaml"
    task = read_recipe(config).get("task") if config.is_file() else None
    if isinstance(task, str) and ":" not in task and task != "sft":
        raise TkError(f"{run_dir} is a {task!r} run; tk chat needs an sft run (`tk run sft_synthetic` makes one)")


def _piped(conversation: Conversation, stdin: TextIO) -> None:
    """One user message per line, one reply per line, nothing else on stdout."""
    for _, line in stream_lines(stdin):
        text = line.strip()
        if not text:
            continue
        if text == EXIT:
            return
        if text == RESET:
            conversation.reset()
            continue
        try:
            conversation.say(text, lambda piece: _write(piece.replace("\n", "\\n")))
        except TkError as e:
            raise TkError(f"{e}{_hint(conversation, f'a {RESET} line')}") from None
        _write("\n")


def _interactive(conversation: Conversation, run_dir: str) -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    click.echo(f"tk chat: {run_dir}. {RESET} forgets the conversation, {EXIT} or Ctrl-D ends it.")
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        if text == EXIT:
            return
        if text == RESET:
            conversation.reset()
            click.echo("(a new conversation)")
            continue
        if text:
            _answer(conversation, text)


def _answer(conversation: Conversation, text: str) -> None:
    """Print the reply as it comes; an error or Ctrl-C ends this turn, not the chat."""
    started = False

    def show(piece: str) -> None:
        nonlocal started
        if not started:
            _write("assistant> ")
            started = True
        _write(piece)

    try:
        conversation.say(text, show)
    except TkError as e:
        click.echo(f"error: {e}{_hint(conversation, RESET)}", err=True)
        return
    except KeyboardInterrupt:
        click.echo("\n(interrupted: this turn is forgotten)")
        return
    if not started:
        _write("assistant> ")
    _write("\n")


def _hint(conversation: Conversation, reset: str) -> str:
    """After earlier turns, how to start over (their tokens may be what no longer fits)."""
    return f"; {reset} starts a new conversation" if conversation.turns else ""


def _write(text: str) -> None:
    click.echo(text, nl=False)
    sys.stdout.flush()  # the terminal shows each piece as it comes
