"""``tk plot`` and ``tk runs``: watching and comparing runs from their ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tk.core.cli.group import debug_option


@click.command("plot")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--metrics", default=None, help="Comma-separated metrics, e.g. val/top1,train/loss "
              "[default: train/loss and the val/* metrics].")
@click.option("--x", "x_axis", type=click.Choice(["step", "epoch", "tokens", "time"]), default="step",
              show_default=True, help="The x axis: optimizer step, epoch, items seen, or training seconds.")
@click.option("-o", "--output", default="curves.png", show_default=True, type=click.Path(dir_okay=False),
              help="The PNG to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing PNG that tk plot wrote.")
@debug_option
def plot_cmd(runs: tuple[str, ...], metrics: str | None, x_axis: str, output: str, overwrite: bool) -> None:
    """Plot training curves of one or more runs into one PNG: a panel per metric, a
    line per run (training metrics smoothed, raw values faint behind).

    \b
    tk plot runs/quickstart
    tk plot runs/a runs/b --metrics val/top1,train/loss --x time -o compare.png
    tk plot runs/quickstart -o curves.png --overwrite   # replace the PNG an earlier tk plot wrote
    """
    from tk.core.run.curves import plot_runs
    from tk.core.run.outputs import check_output

    check_output(output, "tk plot", overwrite, sources=[Path(r) for r in runs])
    names = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
    fig = plot_runs(list(runs), names, x_axis, output)
    panels = sum(ax.get_visible() for ax in fig.axes)
    click.echo(f"wrote {output} ({panels} panel{'s' * (panels > 1)}, {len(runs)} run{'s' * (len(runs) > 1)})")


@click.command("runs")
@click.argument("folder", default="runs", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per run (for scripts).")
@click.option("--sort", "sort_metric", default=None, help="Sort by the best value of this metric, best first "
              "(e.g. val/top1; lowest first for a *loss metric).")
@debug_option
def runs_cmd(folder: str, as_json: bool, sort_metric: str | None) -> None:
    """List the runs under FOLDER (default: runs): task, recipe, status (finished /
    interrupted at step N / failed), steps, best metric and its step, wall time."""
    from tk.core.cli.runs import format_runs, list_runs

    if (Path(folder) / "sweep.yaml").is_file():  # a tk sweep dir: its trials, best first
        from tk.core.engine.sweep import trial_rows

        rows = trial_rows(Path(folder))
        click.echo(json.dumps(rows) if as_json else format_trials(rows))
        return
    runs = list_runs(folder, sort=sort_metric)
    click.echo(json.dumps(runs) if as_json else format_runs(runs, folder))


def format_trials(rows: list[dict]) -> str:
    """A sweep's trials as a table: number, state, objective, parameters, run dir or error."""
    lines = [f"{'trial':>5}  {'state':<8}  {'value':>10}  parameters"]
    for r in rows:
        value = f"{r['value']:.4f}" if r["value"] is not None else "-"
        params = " ".join(f"{k}={f'{v:.4g}' if isinstance(v, float) else v}" for k, v in r["params"].items())
        tail = f"  ({r['error']})" if r.get("error") else ""
        lines.append(f"{r['trial']:>5}  {r['state']:<8}  {value:>10}  {params}{tail}")
    return "\n".join(lines)
