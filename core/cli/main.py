"""The ``tk`` command line: run, list, info, config, validate, summary, eval, average, predict,
export, new-task (plus plugin commands from the ``tk.commands`` entry-point group).

Exit codes: 0 success; 2 usage or config error (one line, nothing on disk touched);
1 failure during a run (one line; the full traceback with ``--debug``).

Each command imports the engine parts it needs inside its function: they load torch
(about a second), which ``tk --help``, ``tk --version`` and ``tk list`` must not wait for.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import sys
from pathlib import Path

import click

import tk
from tk.core.cli.export_cmd import export_cmd
from tk.core.cli.group import CliGroup, debug_option, debug_requested
from tk.core.cli.plugin_commands import describe_command
from tk.core.cli.sweep_cmd import sweep_cmd
from tk.core.cli.watch_cmds import plot_cmd, runs_cmd
from tk.core.errors import TkError


@click.group(cls=CliGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tk.__version__, "--version", prog_name="tk", message="%(prog)s %(version)s")
@debug_option
def cli() -> None:
    """tk: train Transformer tasks from YAML recipes.

    \b
    tk run quickstart                       # a built-in recipe by name
    tk run recipes/vit_cifar.yaml train.max_steps=100 optim.lr=1e-3
    tk run quickstart --nproc-per-node 2    # two processes (DDP)
    tk eval runs/quickstart --split test    # metrics of the best checkpoint
    tk list                                 # tasks and built-in recipes
    """


recipe_argument = click.argument("recipe")
overrides_argument = click.argument("overrides", nargs=-1)


@cli.command("list")
@debug_option
def list_cmd() -> None:
    """List installed tasks, plugin commands and recipes (built-in and plugins'), each with
    its distribution and version.

    Reads package metadata only: no plugin is imported (`tk info NAME` imports one)."""
    from tk.core.recipe import list_recipes
    from tk.core.registry import discover, discover_commands

    click.echo("tasks:")
    entries = discover()
    if not entries:
        click.echo("  (none installed)")
    for name, entry in entries.items():
        click.echo(f"  {name:<24} {'[' + entry.provider + ']':<16} {_task_about(entry)}")
    commands = discover_commands()
    if commands:
        click.echo("commands:")
        for name, entry in commands.items():
            click.echo(f"  {name:<24} {describe_command(entry, cli.commands)}")
    click.echo("recipes:")
    for r in list_recipes():
        about = f"ERROR: {r.problem}" if r.problem else _recipe_summary(r.path)
        click.echo(f"  {r.name:<24} {'[' + r.provider + ']':<16} {about}")


def _task_about(entry) -> str:
    """A task's line in `tk list`: its distribution's Summary, or where to look."""
    if entry.conflicts:
        return f"CONFLICT: claimed by {entry.claimants}"
    # tk's own Summary describes the toolkit, not its built-in tasks
    if entry.summary and entry.distribution != "tk":
        return f"{entry.summary}  (run tk info {entry.name})"
    return f"(run tk info {entry.name})"


def _recipe_summary(path: Path) -> str:
    """The first comment line of a recipe file."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


@cli.command("new-task")
@click.argument("name")
@click.option("--dir", "parent", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Folder in which to create the package folder tk-NAME.")
@click.option("--kind", type=click.Choice(["classification", "tokens", "seq2seq"]), default="classification",
              show_default=True, help="The example the task starts from: one label per sequence, per token, "
                                      "or an output sequence.")
@debug_option
def new_task_cmd(name: str, parent: str, kind: str) -> None:
    """Write a pip-installable task plugin package (task, recipe, test, README) to start from."""
    from tk.core.cli.scaffold import new_task

    created = new_task(name, parent, kind)
    click.echo(f"created {created} (task {name!r}, kind {kind}); next:\n"
               f"  cd {created} && pip install -e .\n  tk run {name}_demo\n  python -m pytest tests")


@cli.command("config")
@recipe_argument
@overrides_argument
@debug_option
def config_cmd(recipe: str, overrides: tuple[str, ...]) -> None:
    """Print the fully resolved config (defaults included) as YAML."""
    from tk.core.recipe import load_config

    cfg, _ = load_config(recipe, list(overrides))
    click.echo(cfg.to_yaml(), nl=False)


@cli.command("validate")
@recipe_argument
@overrides_argument
@debug_option
def validate_cmd(recipe: str, overrides: tuple[str, ...]) -> None:
    """Check a recipe without running it: the schema and cross-field rules, then every check
    `tk run` makes before it writes a run dir (the device and precision on this machine, a
    pretrained source, a distillation teacher, train.best_metric); all but the data.
    With `model.lora`, the model is built too (reading the data, writing nothing), so adapter
    targets or trainable patterns that match nothing are caught here."""
    from tk.core.engine.checks import run_checks
    from tk.core.recipe import load_config
    from tk.core.training.assemble import assemble

    cfg, task_cls = load_config(recipe, list(overrides))
    run_checks(cfg, task_cls, fresh=True)  # the list tk run checks before it writes anything
    if getattr(cfg.sections.get("model"), "lora", None) is not None:  # the patterns need the model's names
        assemble(cfg, task_cls, None, "summary")
    click.echo(f"{cfg.source}: ok (task {cfg.task})")


class RunCommand(click.Command):
    """``tk run``: reads ``--resume auto`` (or ``--resume=auto``) as one option. An option
    with an optional value would take the next word, e.g. an override, as its value, so
    ``--resume`` stays a flag and the two words become the hidden flag ``--resume-auto``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        joined, i = [], 0
        while i < len(args):
            if args[i] == "--":  # what follows is positional
                joined += args[i:]
                break
            if args[i] == "--resume=auto" or (args[i] == "--resume" and args[i + 1:i + 2] == ["auto"]):
                joined.append("--resume-auto")
                i += 1 if "=" in args[i] else 2
                continue
            joined.append(args[i])
            i += 1
        return super().parse_args(ctx, joined)


@cli.command("run", cls=RunCommand)
@recipe_argument
@overrides_argument
@click.option("--resume", is_flag=True,
              help="Continue the run in output_dir from its last checkpoint. `--resume auto`: continue it if "
                   "there is one, else start a new run (a job that torchrun --max-restarts restarts).")
@click.option("--resume-auto", is_flag=True, hidden=True)  # what `--resume auto` becomes (see RunCommand)
@click.option("--resume-from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Like --resume, but continue from this checkpoint file (e.g. a step_*.pt).")
@click.option("--overwrite", is_flag=True,
              help="Replace a previous tk run in output_dir (kept until the new run's first checkpoint).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Train in N processes on this machine (DDP through torchrun; one per GPU).")
@debug_option
@click.pass_context
def run_cmd(ctx: click.Context, recipe: str, overrides: tuple[str, ...], resume: bool, resume_auto: bool,
            resume_from: str | None, overwrite: bool, nproc_per_node: int | None) -> None:
    """Train a recipe: a file path or a built-in recipe name, plus key.sub=value overrides.

    SIGINT (Ctrl-C) or SIGTERM stops after the current update and saves a checkpoint
    (exit code 130 / 143); `--resume` continues exactly where it stopped.
    `--resume auto` continues the run in output_dir if it has a checkpoint, and starts
    one if the dir is empty or absent (or holds a run stopped before its first checkpoint).
    """
    from tk.core.engine.agent import launch
    from tk.core.engine.launch import auto_resume_plan, check_run_dir, run_training
    from tk.core.training.signals import TrainingInterrupted

    if resume_auto and (resume or overwrite or resume_from):
        raise click.UsageError("--resume auto excludes --resume, --resume-from and --overwrite; pick one")
    if nproc_per_node and nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        from tk.core.recipe import load_config

        cfg, _ = load_config(recipe, list(overrides))  # config problems: exit 2 before launching
        if resume_auto:
            auto_resume_plan(cfg.output_dir)  # a foreign folder: exit 2 before launching
        else:
            check_run_dir(cfg.output_dir, resume=resume or bool(resume_from), overwrite=overwrite)
        flags = ["--resume"] * resume + ["--resume", "auto"] * resume_auto + ["--overwrite"] * overwrite
        flags += ["--debug"] * debug_requested(ctx) + (["--resume-from", resume_from] if resume_from else [])
        command = shlex.join(["tk", "run", recipe, *overrides, "--nproc-per-node", str(nproc_per_node)])
        ctx.exit(launch(nproc_per_node, ["run", recipe, *overrides, *flags], debug=debug_requested(ctx),
                        output_dir=cfg.output_dir, command=command))
    main = int(os.environ.get("RANK", "0")) == 0
    try:
        results = run_training(recipe, list(overrides), resume="auto" if resume_auto else resume,
                               overwrite=overwrite, echo=click.echo if main else (lambda _m: None),
                               resume_from=resume_from)
    except TrainingInterrupted as e:
        if main:
            click.echo(str(e), err=True)
        ctx.exit(128 + e.signum)
    if main:
        shown = "  ".join(f"{k}={v:.4f}" for k, v in results.items())
        click.echo(f"done: {shown}" if results else "done: the run had already reached its last step")


@cli.command("summary")
@recipe_argument
@overrides_argument
@debug_option
def summary_cmd(recipe: str, overrides: tuple[str, ...]) -> None:
    """Print every module's output shape on one training batch, with parameter counts
    and the activation memory of that batch (no training, nothing written)."""
    from tk.core.engine.summary import recipe_summary
    from tk.core.recipe import load_config

    cfg, task_cls = load_config(recipe, list(overrides))
    click.echo(recipe_summary(cfg, task_cls))


@cli.command("eval")
@click.argument("run_dir", type=click.Path(file_okay=False))
@overrides_argument
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
@click.option("--split", default="val", show_default=True, type=click.Choice(["val", "test", "train"]),
              help="The split to evaluate.")
@click.option("--ema/--raw", "ema", default=None,
              help="The EMA or the raw weights  [default: the ones the run selected: EMA when best_metric is val_ema/*]")
@click.option("--weights", default=None, help="A bare .safetensors file to evaluate with the run's config.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@debug_option
def eval_cmd(run_dir: str, overrides: tuple[str, ...], checkpoint: str, split: str, ema: bool | None,
             weights: str | None, as_json: bool) -> None:
    """Evaluate a run's checkpoint on a split: the task is rebuilt from the run's saved
    config (plus key.sub=value overrides, e.g. train.eval_batch_size=256)."""
    from tk.core.engine.inference import evaluate_run

    report = evaluate_run(run_dir, checkpoint=checkpoint, split=split, overrides=list(overrides), ema=ema,
                          weights=weights)
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"{report['checkpoint']} (step {report['step']}, {split}{', EMA weights' if report['ema'] else ''}):")
    for key, value in report["metrics"].items():
        click.echo(f"  {key:<20} {value:.4f}")


@cli.command("average")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--last", "last_k", type=click.IntRange(min=1), default=5, show_default=True,
              help="How many of the newest step checkpoints to average.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="avg.pt: a tk checkpoint (for --checkpoint); avg.safetensors: bare weights (for --weights).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output that tk average wrote.")
@debug_option
def average_cmd(run_dir: str, last_k: int, output: str, overwrite: bool) -> None:
    """Average the model weights of a run's last K step checkpoints (the Transformer
    paper's checkpoint averaging): `tk eval RUN --checkpoint avg.pt` then evaluates them."""
    from tk.core.engine.inference import average_run

    report = average_run(run_dir, last_k, output, overwrite)
    click.echo(f"averaged steps {', '.join(map(str, report['steps']))} -> {report['output']}")


@cli.command("predict")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("args", nargs=-1, metavar="[INPUT | section.key=value]...")
@click.option("--input-file", type=click.File("rb"), default=None,
              help="Read inputs from FILE, one per line ('-': standard input).")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Inputs per forward pass.")
@click.option("--device", default=None, help="cpu, cuda, cuda:N or auto  [default: the run's train.device]")
@click.option("--format", "fmt", type=click.Choice(["json", "text"]), default="json", show_default=True,
              help="json: one JSON object per input; text: `input: prediction` lines for people.")
@click.option("--weights", default=None, help="A bare .safetensors file to predict with the run's config.")
@click.option("--ema/--raw", "ema", default=None,
              help="The EMA or the raw weights  [default: the ones the run selected: EMA when best_metric is val_ema/*]")
@debug_option
@click.pass_context
def predict_cmd(ctx: click.Context, run_dir: str, args: tuple[str, ...], input_file, checkpoint: str,
                batch_size: int, device: str | None, fmt: str, weights: str | None, ema: bool | None) -> None:
    """Predict with a trained run on raw inputs (image paths, sentences, prompts).

    \b
    Inputs: the arguments; `-` reads standard input (one input per line); --input-file FILE.
    Overrides: an argument `section.key=value` naming one of the run's config sections is
    an override, not an input (e.g. predict.top_k=3, train.precision=bf16); the task's
    options are such config keys (`tk info TASK` lists them).
    \b
    tk predict runs/quickstart cat.png dog.png predict.top_k=3
    find imgs -name '*.png' | tk predict runs/quickstart - --format text

    Prints one line per input, as each batch finishes. An input that fails gets an
    "error" field (the others are still predicted) and the command then exits with 1.
    """
    from tk.core.engine.inference import predict_run
    from tk.core.engine.predict import format_record, read_inputs, run_sections, split_overrides

    overrides, raw_inputs = split_overrides(args, run_sections(run_dir))
    if not raw_inputs and input_file is None:
        raise click.UsageError("no inputs: pass INPUT arguments, `-` for standard input, or --input-file FILE")
    inputs = read_inputs(raw_inputs, sys.stdin, input_file)
    total = failed = 0
    for record in predict_run(run_dir, inputs, checkpoint, overrides, batch_size, device, weights, ema):
        total += 1
        failed += "error" in record
        click.echo(format_record(record, fmt))
    if failed:
        click.echo(f"error: {failed} of {total} inputs failed (see their error fields)", err=True)
        ctx.exit(1)


@cli.command("info")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
@debug_option
def info_cmd(name: str, as_json: bool) -> None:
    """Describe a task: every config key of its sections and of core's (optim, schedule,
    train) with type, default and doc; or where a plugin command comes from.
    Imports that one plugin (a broken one fails here with its error)."""
    from tk.core.cli.docs import format_task_info, task_info
    from tk.core.config import core_schema
    from tk.core.registry import discover, discover_commands, load_command, load_entry, load_task

    tasks, commands = discover(), discover_commands()
    if name in tasks or ":" in name:
        entry = tasks.get(name)
        task_cls = load_entry(entry) if entry else load_task(name)
        info = task_info(task_cls, core_schema(), entry)
        click.echo(json.dumps(info) if as_json else format_task_info(info))
        return
    if name in commands:
        entry = commands[name]
        command = load_command(entry, builtin=cli.commands)
        info = {"command": name, "entry_point": entry.value, "distribution": entry.distribution,
                "version": entry.version, "help": command.get_short_help_str(200)}
        click.echo(json.dumps(info) if as_json else
                   f"tk {name}: {info['help']}\n  from {entry.provider} ({entry.value})")
        return
    known = [*tasks, *commands]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TkError(f"unknown task or plugin command {name!r}{hint} (installed: {', '.join(known) or 'none'}; "
                  f"run `tk list`)")


cli.add_command(plot_cmd)
cli.add_command(runs_cmd)
cli.add_command(export_cmd)
cli.add_command(sweep_cmd)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="tk")


if __name__ == "__main__":  # pragma: no cover
    main()
