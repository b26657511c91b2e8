"""The ``tk`` command line: run, list, config, validate, predict.

Exit codes: 0 success; 2 usage or config error (one line, nothing on disk touched);
1 failure during a run (one line; the full traceback with ``--debug``).
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from pathlib import Path

import click

import tk
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
    """A click group that turns exceptions into one-line errors and exit codes."""

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
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        except Exception as e:  # a failure during a run
            if _debug_requested(ctx):
                traceback.print_exc()
            else:
                hint = " (run with --debug for the full traceback)"
                click.echo(f"error: {type(e).__name__}: {e}{hint}", err=True)
            ctx.exit(1)


@click.group(cls=TkGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tk.__version__, "--version", prog_name="tk", message="%(prog)s %(version)s")
@debug_option
def cli() -> None:
    """tk: train Transformer tasks from YAML recipes.

    \b
    tk run quickstart                       # a built-in recipe by name
    tk run recipes/vit_cifar.yaml train.max_steps=100 optim.lr=1e-3
    tk list                                 # tasks and built-in recipes
    """


recipe_argument = click.argument("recipe")
overrides_argument = click.argument("overrides", nargs=-1)


@cli.command("list")
@debug_option
def list_cmd() -> None:
    """List installed tasks (with their distributions) and built-in recipes."""
    from tk.core.config import builtin_recipes
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
    from tk.core.config import load_config

    cfg, _ = load_config(recipe, list(overrides))
    click.echo(cfg.to_yaml(), nl=False)


@cli.command("validate")
@recipe_argument
@overrides_argument
@debug_option
def validate_cmd(recipe: str, overrides: tuple[str, ...]) -> None:
    """Check a recipe (schema and cross-field rules) without running it."""
    from tk.core.config import load_config

    cfg, _ = load_config(recipe, list(overrides))
    click.echo(f"{cfg.source}: ok (task {cfg.task})")


def prepare_run_dir(output_dir: str, resume: bool, overwrite: bool) -> Path:
    """Make sure a run never silently overwrites a previous one.

    Raises:
        TkError: the dir holds files and neither flag is given; or --overwrite would
            delete a folder that is not a tk run dir.
    """
    run_dir = Path(output_dir)
    if resume and overwrite:
        raise TkError("--resume and --overwrite exclude each other; pick one")
    occupied = run_dir.exists() and any(run_dir.iterdir())
    if run_dir.exists() and not run_dir.is_dir():
        raise TkError(f"output_dir {str(run_dir)!r} is a file, not a directory; choose another output_dir=...")
    if resume:
        if not occupied:
            raise TkError(f"--resume: {str(run_dir)!r} holds no previous run; drop --resume to start one")
        return run_dir
    if occupied and not overwrite:
        raise TkError(f"output_dir {str(run_dir)!r} is not empty (a previous run?); pass --resume to "
                      f"continue it, --overwrite to replace it, or set output_dir=<new dir>")
    if occupied and overwrite:
        if not (run_dir / "config.yaml").exists():
            raise TkError(f"--overwrite: {str(run_dir)!r} does not look like a tk run dir (no config.yaml); "
                          f"refusing to delete it, choose another output_dir=...")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


@cli.command("run")
@recipe_argument
@overrides_argument
@click.option("--resume", is_flag=True, help="Continue the run in output_dir from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Delete a previous run in output_dir first.")
@debug_option
def run_cmd(recipe: str, overrides: tuple[str, ...], resume: bool, overwrite: bool) -> None:
    """Train a recipe: a file path or a built-in recipe name, plus key.sub=value overrides."""
    from tk.core.config import load_config
    from tk.core.train import Trainer, preflight

    cfg, task_cls = load_config(recipe, list(overrides))
    preflight(cfg)  # device and precision problems, before anything is written
    run_dir = prepare_run_dir(cfg.output_dir, resume=resume, overwrite=overwrite)
    if not resume:
        (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    click.echo(f"run dir: {run_dir}")
    trainer = Trainer(cfg, task_cls, run_dir)
    if resume:
        trainer.resume()
    results = trainer.fit()
    shown = "  ".join(f"{k}={v:.4f}" for k, v in results.items())
    click.echo(f"done: {shown}")


@cli.command("predict")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("inputs", nargs=-1, required=True)
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
@click.option("--top-k", default=5, show_default=True, help="How many classes/candidates to show.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of text.")
@debug_option
def predict_cmd(run_dir: str, inputs: tuple[str, ...], checkpoint: str, top_k: int, as_json: bool) -> None:
    """Predict with a trained run on raw inputs (image paths, sentences, prompts)."""
    from tk.core.inference import load_run

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
