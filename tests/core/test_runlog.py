"""Run logging helpers."""


def test_throughput_leaves_evaluation_time_out(monkeypatch):
    from types import SimpleNamespace

    from tk.core.engine import runlog

    clock_times = iter([0.0, 10.0, 14.0])
    monkeypatch.setattr(runlog, "time", SimpleNamespace(perf_counter=lambda: next(clock_times)))
    clock = runlog.Throughput()  # t=0
    clock.exclude(6.0)  # e.g. an evaluation in the middle of the logging window
    assert clock.lap(40) == (10.0, 4.0)  # 40 items over 10 s - 6 s of evaluation
    assert clock.lap(8) == (2.0, 4.0)  # the exclusion applied to one lap only
