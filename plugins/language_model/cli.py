"""``tk generate RUN --prompt TEXT``: continue a prompt with a trained language-model run."""

from __future__ import annotations

import dataclasses
import sys

import click

from tk.core.engine.inference import load_run
from tk.core.errors import TkError


@click.command("generate")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("overrides", nargs=-1, metavar="[section.key=value]...")
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate  [default: the run's generate.max_len]")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
def generate(run_dir: str, overrides: tuple[str, ...], prompt: str, max_new_tokens: int | None,
             checkpoint: str) -> None:
    """Generate text after --prompt with a trained language_model run (KV-cached).

    \b
    Settings are keys of the run's `generate:` section, set as overrides:
    tk generate runs/lm_synthetic --prompt "the cat" generate.strategy=sample \\
        generate.temperature=0.8 generate.top_k=20 generate.seed=0
    Tokens are printed as they are generated (streamed).
    """
    task, model = load_run(run_dir, checkpoint, list(overrides))
    if task.name != "language_model":
        raise TkError(f"{run_dir} is a {task.name!r} run; tk generate needs a language_model run")
    cfg = task.gen_cfg if max_new_tokens is None else dataclasses.replace(task.gen_cfg, max_len=max_new_tokens)
    click.echo(prompt, nl=False)
    sys.stdout.flush()
    task.continue_text(model, prompt, cfg, on_text=_print_now)
    click.echo()


def _print_now(text: str) -> None:
    click.echo(text, nl=False)
    sys.stdout.flush()  # the terminal shows each token as it comes
