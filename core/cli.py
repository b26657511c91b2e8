"""The ``tk`` command line: run, list, config, validate, summary, eval, average, predict.

Exit codes: 0 success; 2 usage or config error (one line, nothing on disk touched);
1 failure during a run (one line; the full traceback with ``--debug``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import click

import tk
from tk.core.engine.launch import prepare_run_dir  # noqa: F401  (re-exported: the CLI's run-dir rules)
from tk.core.errors import TkError

DEBUG_ENV = "TK_DEBUG"


def _debug_requested(ctx: click.Context) -> bool:
    return bool(ctx.meta.get("tk.debug")) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _set_debug(ctx: click.Context, _param, value: bool) -> bool:
    if value:
        ctx.meta["tk.debug"] = True
    return value


debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                            help="Show full tracebacks (also: TK_DEBUG=1).")


class TkGroup(click.Group):
    """A click group that turns exceptions into one-line errors and exit codes: click's
    own usage errors and TkError exit 2 (a RunError, found during a run, exits 1)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            click.echo(f"error: {_one_line(e.format_message())}{where}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except TkError as e:
            if _debug_requested(ctx):
                traceback.print_exc()
            click.echo(f"error: {_one_line(str(e))}", err=True)
            ctx.exit(e.exit_code)
        except Exception as e:  # a failure during a run
            if _debug_requested(ctx):
                traceback.print_exc()
            else:
                hint = " (run with --debug for the full traceback)"
                click.echo(f"error: {type(e).__name__}: {_one_line(str(e))}{hint}", err=True)
            ctx.exit(1)


def _one_line(message: str) -> str:
    return " ".join(message.split())


@click.group(cls=TkGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
    """List installed tasks (with their distributions) and built-in recipes."""
    from tk.core.recipe import builtin_recipes
    from tk.core.registry import discover, load_entry

    click.echo("tasks:")
    entries = discover()
    if not entries:
        click.echo("  (none installed)")
    for name, entry in entries.items():
        where = f"[{entry.distribution or '?'}]"
        try:
            task_cls = load_entry(entry)
            click.echo(f"  {name:<24} {where:<12} {task_cls.describe()}")
        except Exception as e:  # a broken plugin must not hide the others
            click.echo(f"  {name:<24} {where:<12} BROKEN: {e}")
    click.echo("recipes:")
    for name, path in sorted(builtin_recipes().items()):
        click.echo(f"  {name:<24} {_recipe_summary(path)}")


def _recipe_summary(path: Path) -> str:
    """The first comment line of a recipe file."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


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
    """Check a recipe (schema, cross-field rules, the device and precision on this
    machine) without running it; everything `tk run` checks except the data."""
    from tk.core.engine.device import preflight
    from tk.core.recipe import load_config

    cfg, _ = load_config(recipe, list(overrides))
    preflight(cfg)
    click.echo(f"{cfg.source}: ok (task {cfg.task})")


@cli.command("run")
@recipe_argument
@overrides_argument
@click.option("--resume", is_flag=True, help="Continue the run in output_dir from its last checkpoint.")
@click.option("--resume-from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Like --resume, but continue from this checkpoint file (e.g. a step_*.pt).")
@click.option("--overwrite", is_flag=True,
              help="Replace a previous tk run in output_dir (kept until the new run's first checkpoint).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Train in N processes on this machine (DDP through torchrun; one per GPU).")
@debug_option
@click.pass_context
def run_cmd(ctx: click.Context, recipe: str, overrides: tuple[str, ...], resume: bool, resume_from: str | None,
            overwrite: bool, nproc_per_node: int | None) -> None:
    """Train a recipe: a file path or a built-in recipe name, plus key.sub=value overrides.

    SIGINT (Ctrl-C) or SIGTERM stops after the current update and saves a checkpoint
    (exit code 130 / 143); `--resume` continues exactly where it stopped.
    """
    from tk.core.engine.launch import check_run_dir, launch, run_training
    from tk.core.engine.signals import TrainingInterrupted

    if nproc_per_node and nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        from tk.core.recipe import load_config

        cfg, _ = load_config(recipe, list(overrides))  # config problems: exit 2 before launching
        check_run_dir(cfg.output_dir, resume=resume or bool(resume_from), overwrite=overwrite)
        flags = ["--resume"] * resume + ["--overwrite"] * overwrite + ["--debug"] * _debug_requested(ctx)
        flags += ["--resume-from", resume_from] if resume_from else []
        ctx.exit(launch(nproc_per_node, ["run", recipe, *overrides, *flags]))
    main = int(os.environ.get("RANK", "0")) == 0
    try:
        results = run_training(recipe, list(overrides), resume=resume, overwrite=overwrite,
                               echo=click.echo if main else (lambda _m: None), resume_from=resume_from)
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
@click.option("--ema", is_flag=True, help="Evaluate the EMA weights (runs with train.ema_decay).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@debug_option
def eval_cmd(run_dir: str, overrides: tuple[str, ...], checkpoint: str, split: str, ema: bool, as_json: bool) -> None:
    """Evaluate a run's checkpoint on a split: the task is rebuilt from the run's saved
    config (plus key.sub=value overrides, e.g. train.eval_batch_size=256)."""
    from tk.core.engine.inference import evaluate_run

    report = evaluate_run(run_dir, checkpoint=checkpoint, split=split, overrides=list(overrides), ema=ema)
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"{report['checkpoint']} (step {report['step']}, {split}{', EMA weights' if ema else ''}):")
    for key, value in report["metrics"].items():
        click.echo(f"  {key:<20} {value:.4f}")


@cli.command("average")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--last", "last_k", type=click.IntRange(min=1), default=5, show_default=True,
              help="How many of the newest step checkpoints to average.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The .safetensors file to write.")
@debug_option
def average_cmd(run_dir: str, last_k: int, output: str) -> None:
    """Average the model weights of a run's last K step checkpoints (the Transformer
    paper's checkpoint averaging) into a safetensors file."""
    from tk.core.engine.checkpoint import average_checkpoints, export_safetensors
    from tk.core.engine.inference import step_checkpoints

    steps = step_checkpoints(Path(run_dir))
    if len(steps) < last_k:
        raise TkError(f"--last {last_k}: {run_dir} holds {len(steps)} step checkpoint(s) "
                      f"({', '.join(str(s) for s, _ in steps) or 'none'}); lower --last, or train with "
                      f"train.keep_last>={last_k} and train.save_every=N")
    chosen = steps[-last_k:]
    export_safetensors(average_checkpoints([p for _, p in chosen]), output,
                       metadata={"averaged_steps": ",".join(str(s) for s, _ in chosen)})
    click.echo(f"averaged steps {', '.join(str(s) for s, _ in chosen)} -> {output}")


@cli.command("predict")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("inputs", nargs=-1, required=True)
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
@click.option("--top-k", default=5, show_default=True, help="How many classes/candidates to show.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of text.")
@debug_option
def predict_cmd(run_dir: str, inputs: tuple[str, ...], checkpoint: str, top_k: int, as_json: bool) -> None:
    """Predict with a trained run on raw inputs (image paths, sentences, prompts)."""
    from tk.core.engine.inference import load_run

    task, model = load_run(run_dir, checkpoint)
    for item, pred in zip(inputs, task.predict(model, list(inputs), top_k=top_k)):
        if as_json:
            click.echo(json.dumps({"input": item, **pred}))
        else:
            click.echo(f"{item}: " + _format_prediction(pred))


def _format_prediction(pred: dict) -> str:
    if "top_k" in pred:
        return ", ".join(f"{c['label']} {c['prob']:.3f}" for c in pred["top_k"])
    return json.dumps(pred)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="tk")


if __name__ == "__main__":  # pragma: no cover
    main()
