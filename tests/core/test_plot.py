"""`tk plot`: one PNG, a panel per metric, a line per run (training metrics smoothed
with their raw values behind), x by step, epoch, items seen or time; a run's own
curves.png."""

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from tk.core.cli import cli
from tk.core.errors import TkError
from tk.core.run.curves import plot_runs, smooth, smoothing_weight

from ..conftest import TOY_PLUGIN, TOY_RECIPE, make_distribution


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 40-step toy runs with different learning rates."""
    root = tmp_path_factory.mktemp("plot")
    site = make_distribution(root / "site", "tk-toy", "tk_toy_plugin", TOY_PLUGIN, {"toy": "tk_toy_plugin:ToyTask"})
    (root / "toy.yaml").write_text(TOY_RECIPE)
    sys.path.insert(0, str(site))
    runs = []
    for name, lr in (("fast", "0.02"), ("slow", "0.002")):
        result = invoke("run", root / "toy.yaml", f"output_dir={root / name}", f"optim.lr={lr}", "train.log_every=5")
        assert result.exit_code == 0, result.output
        runs.append(root / name)
    yield runs
    sys.path.remove(str(site))


def records(run_dir, split):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_smoothing_is_the_debiased_moving_average():
    assert smooth([1.0, 2.0], weight=0.6) == pytest.approx([1.0, (0.4 * 0.6 + 0.4 * 2.0) / (1 - 0.36)])
    assert smooth([3.0, 3.0, 3.0], weight=0.9) == pytest.approx([3.0, 3.0, 3.0])  # no bias towards 0 at the start
    assert smoothing_weight(1000) == 0.6 and smoothing_weight(20) == pytest.approx(0.5) and smoothing_weight(8) == 0
    values = [float(v) for v in range(20)]
    assert smooth(values) == pytest.approx(smooth(values, weight=0.5))


def test_plot_two_runs_panels_and_lines(two_runs, tmp_path):
    fast, slow = two_runs
    out = tmp_path / "curves.png"
    result = invoke("plot", fast, slow, "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "3 panels, 2 runs" in result.output

    fig = plot_runs([fast, slow])
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["train/loss", "val/loss", "val/top1"]
    assert [ax.get_ylabel() for ax in axes] == ["train/loss", "val/loss", "val/top1"]
    assert {ax.get_xlabel() for ax in axes} == {"step (optimizer updates)"}
    loss, _, top1 = axes
    assert [line.get_label() for line in loss.get_lines()] == ["_raw", "fast", "_raw", "slow"]
    raw, smoothed = loss.get_lines()[:2]
    expected = [r["loss"] for r in records(fast, "train")]
    assert list(raw.get_xdata()) == list(range(5, 41, 5)) and list(raw.get_ydata()) == expected
    np.testing.assert_allclose(smoothed.get_ydata(), smooth(expected))
    assert raw.get_alpha() < smoothed.get_alpha() if smoothed.get_alpha() is not None else raw.get_alpha() < 1
    assert [line.get_label() for line in top1.get_lines()] == ["fast", "slow"]
    assert list(top1.get_lines()[1].get_ydata()) == [r["val/top1"] for r in records(slow, "val")]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["fast", "slow"]


def test_plot_metric_choice_and_x_axes(two_runs):
    fast, slow = two_runs
    fig = plot_runs([fast, slow], ["val/top1", "train/lr"], x="epoch")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["val/top1", "train/lr"] and axes[0].get_xlabel() == "epoch"
    assert list(axes[0].get_lines()[0].get_xdata()) == [20 / 16, 40 / 16]  # 16 updates per epoch
    tokens = plot_runs([fast], ["train/loss"], x="tokens")
    assert list(tokens.axes[0].get_lines()[0].get_xdata()) == [16.0 * s for s in range(5, 41, 5)]  # batch 16
    timed = plot_runs([fast], ["val/loss"], x="time").axes[0].get_lines()[0].get_xdata()
    assert timed[0] < timed[1]
    with pytest.raises(TkError, match="val/bleu not logged by any of these runs; logged: epoch"):
        plot_runs([fast, slow], ["val/bleu"])
    bad = invoke("plot", fast, "--metrics", "val/bleu")
    assert bad.exit_code == 2 and "logged:" in bad.stderr
    missing = invoke("plot", fast.parent / "nowhere")
    assert missing.exit_code == 2 and "no such directory" in missing.stderr


def test_a_run_draws_its_own_curves_at_evaluations(two_runs):
    fast, _ = two_runs
    assert (fast / "curves.png").read_bytes()[:4] == b"\x89PNG"
