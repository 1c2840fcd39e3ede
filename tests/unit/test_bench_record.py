"""The trainer's record read back (:mod:`torchtitan_seq.instrumentation.record`, what the benchmark and
the tests read a run with) and the per-action timeline. The benchmark's own logic is tested through its
command line: tests/unit/test_bench_refusals.py, tests/e2e/test_bench.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import _Action

from torchtitan_seq.instrumentation import timeline
from torchtitan_seq.instrumentation.record import RECORD_FILE, Run, read_record
from torchtitan_seq.instrumentation.render import bubble_ratios, chrome_trace, timeline_figure
from torchtitan_seq.schedules.ordering import B, F
from torchtitan_seq.titan import metrics


def test_run_reads_the_latest_record_steps_times_bytes_bubbles_and_lengths(tmp_path, monkeypatch):
    """The record as SeqMetricsProcessor writes it (torchtitan's metric names in) read back as a Run."""
    clock = iter([500.0, 1000.0, 1002.5, 1003.0, 1003.75])  # step 1 of an earlier run, start, ...
    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=lambda: next(clock)))
    record = metrics.MetricsRecord(tmp_path / RECORD_FILE)
    record.append({"event": "start", "time": 0.0, "schedule": "1F1B", "lengths": None})  # an earlier run
    record.log({"loss_metrics/global_avg_loss": 9.0}, 1)
    record.append({"event": "start", "time": next(clock), "schedule": "Seq1F1B", "lengths": [128, 128]})
    common = {"memory/max_reserved(GiB)": 0.82, "memory/peak_activation_bytes/rank0": 2097152}
    record.log(
        {
            **common,
            "loss_metrics/global_avg_loss": 8.1,
            "throughput(tps)": 428.0,
            "memory/peak_activation_bytes/rank1": 1048576,
            "pipeline/bubble_ratio/rank0": 0.25,
            "pipeline/bubble_ratio/rank1": 0.125,
            "pipeline/makespan(s)": 2.2505,
        },
        1,
    )
    record.log({"validation_metrics/loss": 8.0}, 1)
    record.log(
        {
            **common,
            "loss_metrics/global_avg_loss": 7.9,
            "throughput(tps)": 1380.0,
            "memory/peak_activation_bytes/rank1": 1048577,
        },
        2,
    )
    run = Run.from_dump_folder(tmp_path)
    assert run.losses == [8.1, 7.9]
    assert run.tps == [428, 1380]
    assert run.step_times_s == pytest.approx([2.5, 1.25])
    assert run.activations_mib == [[2.0, 1.0], [2.0, 1048577 / 2**20]]  # exact, not the console's 0.1 MiB
    assert run.activation_bytes == [[2097152, 1048576], [2097152, 1048577]]
    assert run.bubble_ratios == [[0.25, 0.125], []]  # step 2: stages not timed
    assert run.pipeline_s == [2.2505, None]
    assert run.lengths == [128, 128]
    assert run.validation_losses == [8.0]
    assert [r["event"] for r in read_record(tmp_path / RECORD_FILE)] == ["start", "step", "validation", "step"]
    never_started = Run.from_dump_folder(tmp_path / "never_started", 1, "console")
    assert (never_started.returncode, never_started.output, never_started.losses, never_started.lengths) == (
        1,
        "console",
        [],
        None,
    )


def test_recorder_times_actions_of_the_latest_step_only():
    rec = timeline.StepTimeline()
    with rec.action(0, F, 0):  # not enabled: nothing kept
        pass
    assert rec.intervals() == []
    rec.enable("cpu")
    rec.start_step()
    with rec.action(0, F, 0):
        pass
    rec.start_step()
    with rec.action(0, F, 1):
        pass
    with rec.action(0, B, 1):
        pass
    ivs = rec.intervals()
    assert [a for _, _, a in ivs] == [_Action(0, F, 1), _Action(0, B, 1)]
    assert 0 <= ivs[0][0] <= ivs[0][1] <= ivs[1][0] <= ivs[1][1]


def test_timeline_export_follows_the_profiler_or_the_environment(monkeypatch):
    from types import SimpleNamespace

    traced = SimpleNamespace(enable_profiling=True, profile_freq=3)
    untraced = SimpleNamespace(enable_profiling=False, profile_freq=3)
    assert timeline.export_due(3, traced) and not timeline.export_due(2, traced)
    assert not timeline.export_due(3, untraced)
    monkeypatch.setenv(timeline.FREQ_ENV, "2")
    assert timeline.export_due(2, untraced) and not timeline.export_due(3, untraced)


def test_measured_timeline_goes_through_the_simulator_writers():
    timelines = {
        0: [
            (0.0, 1.0, _Action(0, F, 0)),
            (1.0, 2.0, _Action(0, F, 1)),
            (4.0, 6.0, _Action(0, B, 1)),
            (6.0, 8.0, _Action(0, B, 0)),
        ],
        1: [
            (1.0, 2.0, _Action(1, F, 0)),
            (2.0, 3.0, _Action(1, F, 1)),
            (3.0, 4.0, _Action(1, B, 1)),
            (4.0, 5.0, _Action(1, B, 0)),
        ],
    }
    assert bubble_ratios([6.0, 4.0], [8.0, 5.0]) == [0.25, 0.5]
    result = timeline.measured_result(timelines, "Seq1F1B", 2)
    assert (result.pp, result.microbatches, result.subsequences, result.makespan) == (2, 1, 2, 8.0)
    assert result.bubble_ratio == pytest.approx(0.375)
    events = [e for e in chrome_trace(result)["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 8 and events[2]["args"] == {"stage": 0, "microbatch": 0, "subsequence": 1}
    pytest.importorskip("matplotlib")
    assert timeline_figure(result).axes
