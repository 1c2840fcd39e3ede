"""The benchmark's pieces in one process: the trainer's record read back, variants, calibration,
and the per-action timeline."""

from __future__ import annotations

import json
from types import SimpleNamespace

import bench
import pytest
from torch.distributed.pipelining.schedules import _Action

import training_run
from torchtitan_seq.instrumentation import timeline
from torchtitan_seq.instrumentation.render import bubble_ratios, chrome_trace, timeline_figure
from torchtitan_seq.schedules.ordering import B, F
from torchtitan_seq.titan import metrics


def test_run_reads_the_latest_record_steps_times_bytes_bubbles_and_lengths(tmp_path, monkeypatch):
    """The record as SeqMetricsProcessor writes it (torchtitan's metric names in) read back as a Run."""
    clock = iter([500.0, 1000.0, 1002.5, 1003.0, 1003.75])  # step 1 of an earlier run, start, ...
    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=lambda: next(clock)))
    record = metrics.MetricsRecord(tmp_path / metrics.RECORD_FILE)
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
    run = training_run.Run.from_record(0, "", training_run.read_record(tmp_path / metrics.RECORD_FILE))
    assert run.losses == [8.1, 7.9]
    assert run.tps == [428, 1380]
    assert run.step_times_s == pytest.approx([2.5, 1.25])
    assert run.activations_mib == [[2.0, 1.0], [2.0, 1048577 / 2**20]]  # exact, not the console's 0.1 MiB
    assert run.activation_bytes == [[2097152, 1048576], [2097152, 1048577]]
    assert run.bubble_ratios == [[0.25, 0.125], []]  # step 2: stages not timed
    assert run.pipeline_s == [2.2505, None]
    assert run.lengths == [128, 128]


def test_parse_variants():
    v = bench.parse_variants("1F1B, Seq1F1B,Seq1F1B:8,TeraPipe:2:even", 4, "compute")
    assert v == [
        bench.Variant("1F1B"),
        bench.Variant("Seq1F1B", 4, "compute"),
        bench.Variant("Seq1F1B", 8, "compute"),
        bench.Variant("TeraPipe", 2, "even"),
    ]
    assert v[2].label == "Seq1F1B k=8 compute" and v[0].label == "1F1B"
    for bad in ("1F1B:4", "Seq1F1B:4:bogus", "Seq1F1B:4:even:x"):
        with pytest.raises(ValueError):
            bench.parse_variants(bad, 4, "compute")


def test_instrumentation_ab_alternates_and_reports_the_step_time_ratio():
    """``--instrumentation both``: each schedule instrumented (meter and timeline every step),
    then not; the instrumented record gets its step time over the uninstrumented one's."""
    on, off = bench.parse_variants("Seq1F1B:4", 4, "compute", instrumentation="both")
    assert on.instrumented and not off.instrumented and off.label == "Seq1F1B k=4 compute uninstrumented"
    assert on.overrides()[-2:] == ["--sequence_pipeline.activation_memory_freq", "1"]
    assert off.overrides()[-3:] == [
        "--sequence_pipeline.activation_memory_freq",
        "0",
        "--sequence_pipeline.no-pipeline-timeline",
    ]

    def record(variant, step_time, peaks):
        return bench.Record(
            schedule=variant.schedule,
            label=variant.label,
            compiled=False,
            seq_len=256,
            num_subsequences=4,
            partition="compute",
            lengths=[64] * 4,
            pp=2,
            microbatches=2,
            steps_measured=1,
            step_times_s=[step_time],
            step_time_s=step_time,
            tokens_per_s=512 / step_time,
            peak_activation_bytes=peaks,
            bubble_ratio=None,
            pipeline_time_s=None,
            first_step_s=1.0,
            instrumented=variant.instrumented,
        )

    records = [record(on, 1.1, [2, 1]), record(off, 1.0, None)]
    bench._add_ratios(records)
    assert records[0].instrumentation_cost == pytest.approx(0.1) and records[1].instrumentation_cost is None


def test_the_unit_fit_of_a_length_goes_into_its_cost_files_and_records(tmp_path):
    """Two cuts at one length, units costing 0.1 s each beyond 1 ms per token (no attention)."""
    cuts = {"whole": [512], "even": [128] * 4}
    paths, records = [], []
    for name, lengths in cuts.items():
        times = [0.1 + 1e-3 * n for n in lengths]
        path = tmp_path / f"cost_{name}.json"
        path.write_text(
            json.dumps({"F": [t / 3 for t in times], "B": [2 * t / 3 for t in times], "lengths": lengths, "unit": "s"})
        )
        paths.append(path)
        records.append(SimpleNamespace(lengths=lengths, unit_fit=None, fixed_cost_share=None))
    bench.add_unit_fit(records, paths)
    assert records[1].unit_fit["fixed_s"] == pytest.approx(0.1)
    assert records[1].fixed_cost_share == pytest.approx(0.4 / (0.4 + 0.512))
    assert json.loads(paths[0].read_text())["fixed_share"] == pytest.approx(0.1 / 0.612)


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


@pytest.mark.slow  # a timed calibration of 2 stages: about 12 s
def test_calibration_writes_a_cost_file_the_simulator_reads(tmp_path):
    cost = bench.calibrate(256, [128, 64, 64], 2, units=True, repeats=1)
    first, last = cost["stages"]
    assert all(len(st[p]) == 3 and min(st[p]) > 0 for st in (first, last) for p in "FBW")
    assert first["I"] == [0.0] * 3 and min(last["I"]) > 0  # torch's first stage has no I pass
    assert cost["F"] == cost["stages"][cost["stage"]]["F"]
    # Calibrations of several rounds merge pass by pass: the median of each unit's times.
    slower = {
        **cost,
        "chunk_times": [[{p: [2 * x for x in t[p]] for p in "FBIW"} for t in rank] for rank in cost["chunk_times"]],
    }
    merged = bench.merge([slower, cost, slower])
    assert merged["rounds"] == 3 and merged["lengths"] == [128, 64, 64]
    assert merged["stages"] == [{p: [2 * x for x in st[p]] for p in "FBIW"} for st in cost["stages"]]
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(cost))
    record = bench.Record(
        schedule="Seq1F1B",
        label="Seq1F1B k=3 even",
        compiled=False,
        seq_len=256,
        num_subsequences=3,
        partition="even",
        lengths=[128, 64, 64],
        pp=2,
        microbatches=2,
        steps_measured=1,
        step_times_s=[1.0],
        step_time_s=1.0,
        tokens_per_s=512.0,
        peak_activation_bytes=[1, 1],
        bubble_ratio=None,
        pipeline_time_s=None,
        first_step_s=1.0,
    )
    # Rank 0 alone runs F and B of every unit of both microbatches.
    assert bench.predicted_step_time(record, path) >= 2 * (sum(cost["F"]) + sum(cost["B"]))


@pytest.mark.slow
def test_calibration_times_the_chunks_each_rank_holds():
    """A rank of several model chunks (InterleavedSeq1F1B: rank 0 holds chunks 0 and 2 of 4)
    alternates between them; its times, in the simulator's unit of 1/pp of the layers, are
    its chunks' mean times pp / chunks, the sum here. Chimera's ranks hold both chunks of 2."""
    chunks = bench.chunks_of_ranks("InterleavedSeq1F1B", 2, 4, 2)
    assert chunks == ((0, 2), (1, 3)) and bench.chunks_of_ranks("Chimera", 2, 4, 2) == ((0, 1), (0, 1))
    assert bench.chunks_of_ranks("Seq1F1B", 2, 4, 2) == ((0,), (1,))
    cost = bench.calibrate(256, [128, 128], 2, units=True, chunks=[list(c) for c in chunks], repeats=1)
    assert cost["chunks"] == [[0, 2], [1, 3]]
    for rank, times in zip(cost["stages"], cost["chunk_times"]):
        assert len(times) == 2 and all(min(t["F"]) > 0 for t in times)
        assert rank["F"] == pytest.approx([a + b for a, b in zip(times[0]["F"], times[1]["F"])])
