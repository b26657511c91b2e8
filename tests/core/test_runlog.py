"""Run logging helpers."""


def test_throughput_leaves_evaluation_time_out(monkeypatch):
    from types import SimpleNamespace

    from tk.core.run import runlog

    clock_times = iter([0.0, 10.0, 14.0])
    monkeypatch.setattr(runlog, "time", SimpleNamespace(perf_counter=lambda: next(clock_times)))
    clock = runlog.Throughput()  # t=0
    clock.exclude(6.0)  # e.g. an evaluation in the middle of the logging window
    assert clock.lap(40) == (10.0, 4.0)  # 40 items over 10 s - 6 s of evaluation
    assert clock.lap(8) == (2.0, 4.0)  # the exclusion applied to one lap only


def test_window_record_weights_task_logs_by_items_like_the_loss():
    from tk.core.run.runlog import Throughput, window_record

    window = [{"loss": 1.0, "acc": 0.5, "items": 10.0, "lr": 0.1, "grad_norm": 1.0, "skipped": 0.0},
              {"loss": 3.0, "acc": 1.0, "items": 30.0, "lr": 0.2, "grad_norm": 2.0, "skipped": 1.0}]
    record = window_record(window, Throughput())
    assert record["loss"] == (1.0 * 10 + 3.0 * 30) / 40
    assert record["acc"] == (0.5 * 10 + 1.0 * 30) / 40  # per item, not per update
    assert record["lr"] == 0.2 and record["skipped_steps"] == 1.0


def test_a_plugin_reports_to_train_log_with_task_report_or_its_own_logger(tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli

    recipe = tmp_path / "chatty.yaml"
    recipe.write_text("task: tests.core.chatty_task:ChattyTask\ndata: {num_train: 32, num_val: 8}\n"
                      "train: {max_steps: 1, batch_size: 8, progress: false}\n")
    result = CliRunner().invoke(cli, ["run", str(recipe), f"output_dir={tmp_path / 'run'}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    log = (tmp_path / "run" / "train.log").read_text()
    assert "chatty: 3 rows dropped (empty)" in log and "chatty: built by the plugin's own logger" in log


def test_a_best_metric_a_task_can_only_know_after_set_up_is_never_skipped_silently(tmp_path):
    from click.testing import CliRunner

    from tk.core.cli import cli

    def validate(cls, metric):
        recipe = tmp_path / f"{cls}.yaml"
        recipe.write_text(f"task: tests.core.chatty_task:{cls}\ndata: {{num_train: 32, num_val: 8}}\n")
        return CliRunner().invoke(cli, ["validate", str(recipe), f"train.best_metric={metric}"])

    noted = validate("NeedsSetupTask", "val/top2")
    assert noted.exit_code == 0 and "cannot be checked before the run starts" in noted.output
    refused = validate("DeclaredTask", "val/top2")
    assert refused.exit_code == 2 and "did you mean 'val/top1'" in refused.output
    assert validate("DeclaredTask", "val/top1").exit_code == 0
