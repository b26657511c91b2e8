"""``tk sweep``: search a recipe's keys with Optuna, every trial a normal run (docs/sweeps.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from tk.core.cli.group import debug_option
from tk.core.errors import RunError, TkError


@click.command("sweep")
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--space", type=click.Path(dir_okay=False), default=None,
              help="The search space: a YAML file of params (recipe keys), metric, sampler, pruner.")
@click.option("--trials", type=click.IntRange(min=1), default=None, help="Trials of the study, all workers together.")
@click.option("--dir", "sweep_dir", type=click.Path(file_okay=False), default=None,
              help="The sweep dir (study, trials)  [default: the recipe's output_dir + _sweep].")
@click.option("--storage", default=None, help="The study's storage: a journal file shared by the machines, or a "
              "database URL (sqlite:///, postgresql://, mysql://)  [default: DIR/study.journal].")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes on this machine, each running one trial at a time.")
@click.option("--resume", is_flag=True, help="Continue a sweep: its trials whose worker died are resumed from "
              "their checkpoints (or started again), then new ones run up to --trials.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Run each trial in N processes (DDP through torchrun).")
@click.option("--show", "show_dir", type=click.Path(file_okay=False), default=None,
              help="Summarise the sweep in this dir: best trial, importances, history.png and params.png.")
@click.option("--json", "as_json", is_flag=True, help="--show: print one JSON object.")
@debug_option
def sweep_cmd(recipe: str | None, overrides: tuple[str, ...], space: str | None, trials: int | None,
              sweep_dir: str | None, storage: str | None, jobs: int, resume: bool, nproc_per_node: int | None,
              show_dir: str | None, as_json: bool) -> None:
    """Run --trials trials of RECIPE (with key=value overrides) over the keys of --space, each a
    normal run in DIR/trial_NNNN; the objective is each trial's best metric.

    \b
    tk sweep quickstart --space space.yaml --trials 20
    tk sweep quickstart --space space.yaml --trials 20 --jobs 2          # two workers, one study
    tk sweep quickstart --space space.yaml --trials 20 --resume          # after a kill
    tk sweep --show runs/quickstart_sweep                                # best trial, importances, PNGs
    """
    if show_dir is not None:
        _show(show_dir, as_json)
        return
    if recipe is None or space is None or trials is None:
        raise click.UsageError("tk sweep needs RECIPE, --space FILE and --trials N (or --show DIR)")
    from tk.core.engine.sweep import WORKER_ENV, run_sweep

    sweep = _checked_sweep(recipe, list(overrides), space, trials, sweep_dir, storage, nproc_per_node)
    worker_args = [recipe, *overrides, "--space", space, "--trials", str(trials), "--dir", str(sweep.sweep_dir),
                   "--storage", sweep.storage, *(["--resume"] if resume else []),
                   *(["--nproc-per-node", str(nproc_per_node)] if nproc_per_node else [])]
    try:
        study = run_sweep(sweep, resume, jobs, worker_args, click.echo)
    except KeyboardInterrupt:
        click.echo(f"sweep interrupted; continue it with: tk sweep {' '.join(worker_args)} --resume"
                   if not resume else f"sweep interrupted; continue it with: tk sweep {' '.join(worker_args)}",
                   err=True)
        raise SystemExit(130) from None
    if os.environ.get(WORKER_ENV):  # a --jobs worker: the process the user started sums up, once
        return
    states: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        states[t.state.name.lower()] = states.get(t.state.name.lower(), 0) + 1
    best = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    line = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    click.echo(f"sweep: {sum(states.values())} trials ({line}) in {sweep.sweep_dir}")
    if best:
        top = study.best_trial
        params = " ".join(f"{k}={v}" for k, v in top.params.items())
        click.echo(f"best: trial {top.number} {sweep.metric}={top.value:.4f} {params} "
                   f"({top.user_attrs.get('run_dir')}); tk sweep --show {sweep.sweep_dir}")
    elif states.get("fail"):  # not one trial finished: the sweep failed, with the first failure's line
        first = min((t for t in study.get_trials(deepcopy=False) if t.state.name == "FAIL"), key=lambda t: t.number)
        raise RunError(f"every trial failed; the first, trial {first.number}: "
                       f"{first.user_attrs.get('error', 'see its log in ' + str(sweep.sweep_dir / 'logs')).removeprefix('error: ')}")


def _checked_sweep(recipe: str, overrides: list[str], space_file: str, trials: int, sweep_dir: str | None,
                   storage: str | None, nproc: int | None):
    """The sweep, after every check a trial would fail on: the space, each key against the
    recipe's schema, the metric (logged by the task), the machine; one line each."""
    from tk.core.engine.checks import run_checks
    from tk.core.engine.search_space import load_space
    from tk.core.engine.sweep import JOURNAL_FILE, Sweep
    from tk.core.recipe import load_config

    space = load_space(space_file)
    cfg, task_cls = load_config(recipe, overrides)
    t = cfg.train
    metric = space.metric or t.best_metric or "val/loss"
    mode = t.best_mode if not space.metric else None
    direction = space.direction or ("minimize" if (mode or ("min" if metric.endswith("loss") else "max")) == "min"
                                    else "maximize")
    try:
        example = {p.key: p.example() for p in space.searched}
        cfg, task_cls = load_config(recipe, [*overrides, *space.overrides(example), f"train.best_metric={metric}"])
    except TkError as e:
        raise TkError(f"--space {space_file}: {e}") from None
    for p in space.searched:  # every choice and both bounds, not only the example: a bad one fails no trial later
        for value in p.choices if p.kind == "categorical" else (p.low, p.high):
            try:
                load_config(recipe, [*overrides, *space.overrides({**example, p.key: value}),
                                     f"train.best_metric={metric}"])
            except TkError as e:
                what = "choice" if p.kind == "categorical" else "bound"
                raise TkError(f"--space {space_file}: {p.key}: the {what} {value!r} is refused: {e}") from None
    try:
        run_checks(cfg, task_cls, fresh=True)  # e.g. a metric the task does not log, before any trial
    except TkError as e:  # the space file's metric: named as the user wrote it, not as the key tk set
        if not space.metric or "train.best_metric" not in str(e):
            raise
        raise TkError(f"--space {space_file}: " + str(e).replace("train.best_metric", "metric")) from None
    folder = Path(sweep_dir) if sweep_dir else Path(f"{cfg.output_dir.rstrip('/')}_sweep")
    return Sweep(recipe, overrides, space, metric, direction, trials, folder, storage or str(folder / JOURNAL_FILE),
                 nproc)


def _show(show_dir: str, as_json: bool) -> None:
    from tk.core.engine.sweep_show import show_sweep

    summary = show_sweep(show_dir)
    if as_json:
        click.echo(json.dumps(summary))
        return
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary["counts"].items()))
    click.echo(f"sweep {show_dir}: {counts}; objective {summary['metric']} ({summary['direction']})")
    best = summary["best"]
    if best is None:
        click.echo("no trial has completed yet")
        return
    params = " ".join(f"{k}={v}" for k, v in best["params"].items())
    click.echo(f"best: trial {best['trial']} {summary['metric']}={best['value']:.4f} {params} ({best['run_dir']})")
    if summary["importances"]:
        click.echo("importance: " + "  ".join(f"{k} {v:.2f}" for k, v in summary["importances"].items()))
    for png in summary["pngs"]:
        click.echo(f"wrote {png}")
