"""The benchmark's command line and the trainer's TensorBoard pipeline figures, through ./run_train.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import bench
import pytest

from titan import assert_trained, run_train
from torchtitan_seq.instrumentation import timeline


@pytest.mark.slow
def test_bench_cli_smoke(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            bench.__file__,
            "--seq-lens",
            "256",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--schedules",
            "1F1B,DualPipeV,Seq1F1B",  # DualPipeV: refused on a CPU by the job check, left out
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
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "skipped: DualPipeV at seq 256, refused by the job check: parallelism.pipeline_parallel_schedule" in proc.stderr
    )
    records = json.loads((out / "bench.json").read_text())
    assert [(r["schedule"], r["num_subsequences"], r["partition"]) for r in records] == [
        ("1F1B", 1, None),
        ("Seq1F1B", 4, "compute"),
    ]
    for r in records:
        assert r["seq_len"] == 256 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert len(r["peak_activation_bytes"]) == 2 and min(r["peak_activation_bytes"]) > 0
        assert r["tokens_per_s_ratio"] > 0 and r["peak_activation_ratio"] > 0
        assert r["predicted_step_time_s"] > 0 and json.loads((out / r["cost_file"]).read_text())["rounds"] == 1
    assert records[0]["bubble_ratio"] is None and len(records[1]["bubble_ratio"]) == 2
    assert 0 < records[1]["pipeline_time_s"] < records[1]["step_time_s"]
    assert records[1]["partition"] == "compute" and sum(records[1]["lengths"]) == 256
    assert (out / "bench.md").is_file() and (out / "bench.png").stat().st_size > 0


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
