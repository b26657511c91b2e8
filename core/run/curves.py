"""Training curves without a service: ``tk plot RUN [RUN ...]`` and the ``curves.png``
a run writes at its evaluations.

One PNG (matplotlib's Agg canvas, no pyplot, no display), one panel per metric, one
line per run; training metrics are drawn smoothed (TensorBoard's debiased exponential
moving average) with their raw values faint behind. The data is each run's
``metrics.jsonl`` under the logger names of :func:`tk.core.run.loggers.scalars`
(``train/loss``, ``val/top1``, ...).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.core.errors import TkError
from tk.core.run.atomic import atomic_write
from tk.core.run.loggers import read_records, scalars
from tk.core.run.outputs import WRITTEN_BY

__all__ = ["X_AXES", "RunSeries", "load_series", "default_metrics", "smoothing_weight", "smooth", "plot_runs", "CurvesWriter"]

# --x choice -> (the record field it reads, the axis label)
X_AXES = {"step": ("step", "step (optimizer updates)"), "epoch": ("epoch", "epoch"),
          "tokens": ("items_seen", "items seen (tokens or samples)"), "time": ("time", "training time (s)")}
MAX_DEFAULT_PANELS = 6
SMOOTHING = 0.6  # TensorBoard's default weight


@dataclass
class RunSeries:
    """One run's curves: ``points[metric]`` is a list of ``(axes, value)`` where ``axes``
    maps step/epoch/items_seen/time to that point's value (None where unknown)."""

    name: str
    path: Path
    points: dict[str, list[tuple[dict[str, Any], float]]] = field(default_factory=dict)


def load_series(run_dir: str | Path, name: str | None = None) -> RunSeries:
    """Read a run dir's ``metrics.jsonl`` into curves.

    Raises:
        TkError: the folder or its ``metrics.jsonl`` is missing or holds no records.
    """
    path = Path(run_dir)
    jsonl = path / "metrics.jsonl"
    if not path.is_dir():
        raise TkError(f"run {str(path)!r}: no such directory; pass a run dir (output_dir of `tk run`)")
    records = read_records(jsonl)
    if not records:
        raise TkError(f"run {str(path)!r}: {'no metrics.jsonl' if not jsonl.is_file() else 'metrics.jsonl is empty'};"
                      f" is it a run dir that has logged a step?")
    series = RunSeries(name or path.resolve().name, path)
    last = {"items_seen": None, "time": None}  # evaluation records carry no item count: the last training one's
    for record in records:
        if record.get("split") == "train":
            last.update({k: record.get(k) for k in last})
        axes = {"step": record.get("step"), "epoch": record.get("epoch"),
                "items_seen": record.get("items_seen", last["items_seen"]), "time": record.get("time", last["time"])}
        for metric, value in scalars(record).items():
            series.points.setdefault(metric, []).append((axes, value))
    return series


def default_metrics(runs: list[RunSeries]) -> list[str]:
    """``train/loss`` and the ``val/*`` metrics of the runs (at most six panels)."""
    seen: dict[str, None] = {}
    for run in runs:
        seen.update({m: None for m in run.points if m.startswith("val/")})
    out = (["train/loss"] if any("train/loss" in r.points for r in runs) else []) + sorted(seen, key=_val_order)
    return out[:MAX_DEFAULT_PANELS]


def _val_order(metric: str) -> tuple[int, str]:
    return (0 if metric == "val/loss" else 1, metric)


def smoothing_weight(points: int) -> float:
    """The moving average's weight for a curve of ``points`` values: TensorBoard's 0.6,
    less for short curves (the average spans about a tenth of the curve), whose points
    are already means over ``train.log_every`` updates and would only lag behind."""
    return min(SMOOTHING, max(0.0, 1.0 - 10.0 / max(points, 1)))


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); NaNs are skipped.
    ``weight`` None: :func:`smoothing_weight` of the curve's length."""
    weight = smoothing_weight(len(values)) if weight is None else weight
    out, last, count = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last, count = last * weight + (1 - weight) * v, count + 1
        out.append(last / (1 - weight ** count))
    return out


def plot_runs(run_dirs: list[str | Path], metrics: list[str] | None = None, x: str = "step",
              output: str | Path | None = None):
    """Plot runs' curves: one panel per metric, one line per run.

    Args:
        run_dirs: run directories.
        metrics: logger names (``train/loss``, ``val/top1``); None: :func:`default_metrics`.
        x: ``step``, ``epoch``, ``tokens`` (items seen) or ``time`` (training seconds).
        output: write the PNG here (None: only return the figure).

    Returns:
        The ``matplotlib.figure.Figure``: panel ``i`` has title and y label
        ``metrics[i]``; per run one line (training metrics: a smoothed line and a raw
        one labelled ``_raw``, which legends hide).

    Raises:
        TkError: a run dir without records, an unknown ``x``, a metric no run logged,
            or an x axis (epoch) that no run has.
    """
    # lazy: matplotlib takes about a second to import; `tk runs` and the engine need it only here
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if x not in X_AXES:
        raise TkError(f"--x: {x!r} is not an x axis; use one of {', '.join(X_AXES)}")
    runs = [load_series(d) for d in run_dirs]
    names = [r.name for r in runs]
    for r in runs:  # two runs with the same folder name (runs/a/quick, runs/b/quick): full paths
        if names.count(r.name) > 1:
            r.name = str(r.path)
    metrics = list(metrics) if metrics else default_metrics(runs)
    known = sorted({m for r in runs for m in r.points})
    missing = [m for m in metrics if not any(m in r.points for r in runs)]
    if missing or not metrics:
        raise TkError(f"--metrics: {', '.join(missing) or '(none)'} not logged by "
                      f"{'this run' if len(runs) == 1 else 'any of these runs'}; logged: {', '.join(known)}")
    field_name, xlabel = X_AXES[x]
    cols = min(len(metrics), 3)
    rows = math.ceil(len(metrics) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    plotted_any_x = False
    for ax, metric in zip(axes, metrics):
        for run, color in zip(runs, colors):
            pts = [(a[field_name], v) for a, v in run.points.get(metric, []) if a.get(field_name) is not None]
            if not pts:
                continue
            plotted_any_x = True
            xs, ys = zip(*pts)
            if metric.startswith("train/"):
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1, label="_raw")
                ax.plot(xs, smooth(list(ys)), color=color, linewidth=1.6, label=run.name)
            else:
                ax.plot(xs, ys, color=color, linewidth=1.6, marker="o", markersize=3, label=run.name)
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    if not plotted_any_x:
        raise TkError(f"--x {x}: no run logged {field_name} (an iteration-based run has no epochs); use --x step")
    axes[0].legend(fontsize=8, loc="best")
    width, height = fig.get_size_inches()  # margins in inches (tight_layout costs as much as the drawing)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.15 / width, bottom=0.6 / height, top=1 - 0.35 / height,
                        wspace=0.4, hspace=0.6)
    if output is not None:
        _save(fig, Path(output))
    return fig


def _save(fig, path: Path) -> None:
    """Write the PNG through a temporary file of its own: a reader never sees half a picture."""
    atomic_write(path, lambda f: fig.savefig(f, dpi=90, format="png", metadata={WRITTEN_BY: "tk plot"}))


class CurvesWriter:
    """Re-draws ``<run_dir>/curves.png`` after evaluations (``train.curves``).

    Drawing costs a fraction of a second, so a periodic evaluation redraws only when at
    least ten times the last drawing's duration (at first: half a second, the import
    included) has passed since it or since the run started: the picture costs at most
    ~10% of the run's time, and a run of a few seconds (a test) draws once, at its final
    evaluation, which always redraws.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._last = time.monotonic()
        self._cost = 0.5

    def update(self, final: bool = False) -> None:
        start = time.monotonic()
        if not final and start - self._last < 10 * self._cost:
            return
        try:
            plot_runs([self.run_dir], output=self.run_dir / "curves.png")
        except Exception as e:  # a picture must never cost the run (matplotlib raises many kinds)
            warnings.warn(f"could not write {self.run_dir / 'curves.png'}: {e}", stacklevel=2)
        self._last = time.monotonic()
        self._cost = self._last - start
