"""``tk sweep --show``: the best trial of a sweep, its parameters' importances, and PNGs of the
optimisation history and of each parameter's effect on the objective."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml

from tk.core.engine.study import open_study
from tk.core.engine.sweep import SWEEP_FILE, trial_rows
from tk.core.errors import TkError

__all__ = ["show_sweep"]


def show_sweep(sweep_dir: str | Path) -> dict[str, Any]:
    """Summarise the sweep in ``sweep_dir`` and write ``history.png`` and ``params.png`` there.

    Returns:
        ``{"metric", "direction", "best": row or None, "importances": {key: share}, "counts":
        {state: n}, "pngs": [paths]}``.

    Raises:
        TkError: not a sweep dir.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.exists():
        raise TkError(f"tk sweep --show: {sweep_dir} does not exist; give the --dir of a sweep (`tk runs` lists runs)")
    if not (sweep_dir / SWEEP_FILE).is_file():
        raise TkError(f"tk sweep --show: {sweep_dir} holds no sweep ({SWEEP_FILE} missing); give the --dir of a sweep")
    definition = yaml.safe_load((sweep_dir / SWEEP_FILE).read_text(encoding="utf-8"))
    study = open_study(definition)
    rows = trial_rows(sweep_dir)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    complete = [r for r in rows if r["state"] == "complete"]
    importances: dict[str, float] = {}
    pngs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna's matplotlib plots are "experimental"
        if len(complete) >= 2 and len({tuple(sorted(r["params"].items())) for r in complete}) >= 2:
            try:
                importances = optuna.importance.get_param_importances(study)
            except (RuntimeError, ValueError):  # too few distinct trials for the evaluator
                importances = {}
        if complete:
            for name, plot in (("history.png", ovm.plot_optimization_history), ("params.png", ovm.plot_slice)):
                ax = plot(study)
                fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
                fig.set_size_inches(max(6.0, 4.0 * len(rows[0]["params"])) if name == "params.png" else 7.0, 4.0)
                fig.tight_layout()
                fig.savefig(sweep_dir / name, dpi=100)
                plt.close(fig)
                pngs.append(str(sweep_dir / name))
    return {"metric": definition["metric"], "direction": definition["direction"],
            "best": complete[0] if complete else None, "importances": importances, "counts": counts,
            "pngs": pngs}
