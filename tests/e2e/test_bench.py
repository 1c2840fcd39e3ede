"""The benchmark's command line (benchmarks/bench.py) and the trainer's TensorBoard pipeline figures,
through ./run_train.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan import assert_trained, run_train
from torchtitan_seq.instrumentation import timeline

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


@pytest.mark.slow  # 6 training runs and 3 calibrations: about 2 minutes on 2 cores
def test_bench_measures_calibrates_and_predicts(tmp_path):
    """One round of 2 steps at 256 tokens, calibrated, every schedule instrumented and not: a run of
    torch's schedule, one of a sequence schedule (a stage a rank) and one of an interleaved one (two
    model chunks a rank); DualPipeV is refused on a CPU by the job check, and left out. One test, so
    that the runs are made once."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--seq-lens",
            "256",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--schedules",
            "1F1B,DualPipeV,Seq1F1B,InterleavedSeq1F1B",
            "--instrumentation",
            "both",
            "--calibrate",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        # Valid jobs: run_train.sh may skip its start-up check (every rank checks the job).
        env={**os.environ, "TORCHTITAN_SEQ_SKIP_CHECK": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads((out / "bench.json").read_text())
    _check_records(records, proc.stderr)
    assert (out / "bench.md").is_file() and (out / "bench.png").stat().st_size > 0
    _check_calibration(records, out)


def _check_records(records: list[dict], stderr: str) -> None:
    """Each schedule instrumented and not, against 1F1B run alike; the instrumentation's cost."""
    for arm in ("", " uninstrumented"):
        message = (
            f"skipped: DualPipeV{arm} at seq 256, refused by the job check: parallelism.pipeline_parallel_schedule"
        )
        assert message in stderr
    assert [(r["schedule"], r["num_subsequences"], r["partition"], r["instrumented"]) for r in records] == [
        (name, k, partition, instrumented)
        for name, k, partition in (("1F1B", 1, None), ("Seq1F1B", 4, "compute"), ("InterleavedSeq1F1B", 4, "compute"))
        for instrumented in (True, False)
    ]
    for r in records:
        assert r["seq_len"] == 256 and sum(r["lengths"]) == 256 and r["steps_measured"] == 1
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s_ratio"] > 0
    for on, off in zip(records[::2], records[1::2]):
        assert off["label"] == on["label"] + " uninstrumented"
        assert len(on["peak_activation_bytes"]) == 2 and min(on["peak_activation_bytes"]) > 0
        assert on["peak_activation_ratio"] > 0 and off["peak_activation_bytes"] is None
        assert on["instrumentation_cost"] == pytest.approx(on["step_time_s"] / off["step_time_s"] - 1)
        assert off["instrumentation_cost"] is None and off["bubble_ratio"] is None
    one_f_one_b, seq1f1b = records[0], records[2]
    assert one_f_one_b["bubble_ratio"] is None and one_f_one_b["tokens_per_s_ratio"] == 1
    assert len(seq1f1b["bubble_ratio"]) == 2 and 0 < seq1f1b["pipeline_time_s"] < seq1f1b["step_time_s"]


def _check_calibration(records: list[dict], out: Path) -> None:
    """A cost file per cut and layout, merged over the round(s); the simulator's prediction from it, and
    every unit's fit to a fixed cost plus costs per token and per pair."""
    assert {r["cost_file"] for r in records} == {
        "cost_s256_whole_256.json",
        "cost_s256_units_64-64-64-64.json",
        "cost_s256_units_64-64-64-64_chunks-0.2-1.3.json",  # InterleavedSeq1F1B: chunks 0, 2 on rank 0
    }
    for r in records:
        cost = json.loads((out / r["cost_file"]).read_text())
        assert cost["rounds"] == 1 and cost["lengths"] == r["lengths"] and cost["unit"] == "s"
        assert cost["F"] == cost["stages"][cost["stage"]]["F"]
        assert all(len(st[p]) == len(r["lengths"]) and min(st[p]) > 0 for st in cost["stages"] for p in "FBW")
        assert set(r["unit_fit"]) == {"fixed_s", "per_token_s", "per_pair_s"} and 0 <= r["fixed_cost_share"] < 1
        assert cost["unit_fit"] == r["unit_fit"] and "fixed_share" in cost
        assert r["predicted_step_time_s"] > 0
        assert r["prediction_error"] == pytest.approx(r["predicted_step_time_s"] / r["step_time_s"] - 1)
    seq1f1b = next(r for r in records if r["schedule"] == "Seq1F1B")
    first, last = json.loads((out / seq1f1b["cost_file"]).read_text())["stages"]
    assert first["I"] == [0.0] * 4 and min(last["I"]) > 0  # torch's first stage has no I pass
    # Rank 0 runs F and B of every unit of the 4 microbatches.
    assert seq1f1b["predicted_step_time_s"] >= 4 * (sum(first["F"]) + sum(first["B"]))
    interleaved = json.loads((out / records[4]["cost_file"]).read_text())
    assert interleaved["chunks"] == [[0, 2], [1, 3]]
    # A rank's times are its chunks' mean in the simulator's unit of 1/pp of the layers: their sum here.
    for rank, chunks in zip(interleaved["stages"], interleaved["chunk_times"]):
        assert len(chunks) == 2 and all(min(t["F"]) > 0 for t in chunks)
        assert rank["F"] == pytest.approx([a + b for a, b in zip(chunks[0]["F"], chunks[1]["F"])])


@pytest.mark.slow
def test_tensorboard_holds_bubble_ratios_and_the_timeline(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # torchtitan's own profiler, at step 2: its traces and our timeline land side by side.
    profile = (
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "0",
        "--profiling.profiler_active",
        "1",
    )
    run = run_train(
        "--training.seq_len",
        "512",
        "--training.steps",
        "2",
        "--metrics.enable_tensorboard",
        *profile,
        dump_folder=tmp_path,
        check=False,
    )
    assert_trained(run, 2)
    assert all(len(b) == 2 and all(0 <= x < 1 for x in b) for b in run.bubble_ratios), run.bubble_ratios
    assert all(t > 0 for t in run.pipeline_s), run.pipeline_s
    events = list(tmp_path.glob("tb/**/events.out.tfevents.*"))
    assert events, run.output[-3000:]
    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 4})
    acc.Reload()
    tags = {"pipeline/bubble_ratio/rank0", "pipeline/bubble_ratio/rank1", "pipeline/makespan(s)"}
    assert tags <= set(acc.Tags()["scalars"])
    profiled = tmp_path / "profile_trace" / "iteration_2"
    trace = json.loads((profiled / timeline.TRACE_FILE).read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert (profiled / "rank0_trace.json").is_file() and (profiled / "rank1_trace.json").is_file()
    pytest.importorskip("matplotlib")
    assert acc.Tags()["images"] == [timeline.FIGURE_TAG]
