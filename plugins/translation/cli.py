"""``tk translate RUN [FILE|-]``: translate lines with a trained translation run."""

from __future__ import annotations

import sys

import click

from tk.core.engine.inference import load_run
from tk.core.errors import TkError
from tk.core.text.reader import stream_lines


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("input_file", default="-", type=click.File("rb"))
@click.option("--beam", "beam", type=int, default=None, help="beam size (1 = greedy); default decode.beam_size")
@click.option("--checkpoint", default="best", show_default=True, help="best, last or a checkpoint file")
@click.option("--average-last", type=int, default=None, help="average the weights of the last K step checkpoints")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="lines per batch; default decode.batch_size")
@click.option("--truncate", is_flag=True, help="translate the first tokens of a line longer than the model takes "
                                               "(default: such a line is an error)")
def translate(run_dir: str, input_file, beam: int | None, checkpoint: str, average_last: int | None,
              batch_size: int | None, truncate: bool) -> None:
    """Print one translation per line of INPUT_FILE (default: stdin), in order."""
    if beam is not None and beam < 1:
        raise click.UsageError(f"--beam must be >= 1, got {beam}")
    task, model = load_run(run_dir, checkpoint, average_last=average_last)
    if task.name != "translation":
        raise TkError(f"{run_dir} is a {task.name!r} run; tk translate needs a translation run")
    size = batch_size or task.decode_cfg.batch_size
    lines = [line for _, line in stream_lines(input_file)]  # UTF-8, or one error naming the line
    name = getattr(input_file, "name", "-")
    where = "stdin" if name in ("-", "<stdin>") else name
    long = task.too_long(lines)  # every line checked before anything is printed
    if long and not truncate:
        raise TkError(f"{where} line {long[0][0] + 1}: {task.too_long_message(long[0][1])}")
    for start in range(0, len(lines), size):
        for hyp in task.translate(model, lines[start:start + size], beam, truncate=truncate):
            sys.stdout.write(hyp + "\n")
    sys.stdout.flush()
    if long:
        click.echo(f"note: {len(long)} line(s) of {where} cut to the first {task.model_cfg.max_len - 1} tokens "
                   f"(--truncate)", err=True)
