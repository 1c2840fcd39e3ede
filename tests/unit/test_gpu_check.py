"""The prepared GPU check (benchmarks/gpu_check.py) through its CPU dry run.

The dry run goes through the same code as a GPU run, at toy sizes, so the script
cannot rot between GPU runs: its figures must be there and sane, the cost
files it writes must load in the simulator, the one-rank sequence-schedule step
must be exact and the trainer's run must leave its record and TensorBoard events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_seq import simulate as sim

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--device", "cpu", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow  # the dry run: the whole GPU check on a tiny model, about 25 s
def test_dry_run_reports_every_figure(dry_run):
    _, results = dry_run
    for key in (
        "date",
        "device",
        "torch",
        "cuda",
        "flash_attn",
        "kernel_dtypes",
        "attention",
        "overhead",
        "sequence_step",
        "kv_offload",
        "training",
        "elapsed_s",
    ):
        assert key in results, key
    # torch's CPU kernel takes every dtype the check probes
    assert results["kernel_dtypes"] == {"CpuSdpaKernel": {"float32": "ok", "float16": "ok", "bfloat16": "ok"}}
    cases = results["attention"]["cases"]
    kinds = ("full", "window", "chunk", "sinks_narrow_values")
    assert {(c["attention"], c["mask"], c["kernel"], c["status"]) for c in cases} == {
        (kind, mask, "CpuSdpaKernel", "ok") for kind in kinds for mask in ("causal", "block_causal")
    }
    # every cut into units also as microbatches sharing arenas (descending slabs)
    runs = {"96", "24-24-24-24", "24-24-24-24 shared", "40-30-16-10", "40-30-16-10 shared"}
    assert all(set(c["errors"]) == runs for c in cases), [list(c["errors"]) for c in cases]
    tolerance = {"float32": 1e-5, "float16": 5e-2, "bfloat16": 5e-2}
    assert {c["dtype"] for c in cases if c["mask"] == "causal"} == set(tolerance)
    for case in cases:
        for cut, errors in case.get("errors", {}).items():
            sinks = {"dsinks"} if case["attention"] == "sinks_narrow_values" else set()
            assert set(errors) == {"out", "dq", "dk", "dv", *sinks}
            for tensor, error in errors.items():
                assert 0 <= error < tolerance[case["dtype"]], (case["dtype"], cut, tensor, error)

    overhead = results["overhead"]
    assert overhead["compiled"] is False
    runs = overhead["runs"]
    assert {(r["seq_len"], r["path"], r["k"]) for r in runs} == {
        (s, path, k) for s in (128, 256) for path, k in [("whole", 1), ("units", 1), ("units", 2), ("units", 4)]
    }
    for r in runs:
        assert r["status"] == "ok" and r["time_s"] > 0 and len(r["F"]) == len(r["B"]) == r["k"]
        if r["path"] == "units":
            assert "overhead" in r
            assert r["loss_rel_diff"] < 1e-5  # units compute the whole sequence's loss


@pytest.mark.slow  # the dry run: the whole GPU check on a tiny model, about 25 s
def test_dry_run_steps_a_sequence_schedule_on_one_rank(dry_run):
    """Two stages of one pipeline on the one rank, as the GPU runs them, exact in float32."""
    step = dry_run[1]["sequence_step"]
    assert step["status"] == "ok", step
    assert (step["schedule"], step["pp"], step["stages"], step["backend"]) == ("InterleavedSeq1F1B", 1, 2, "gloo")
    assert len(step["lengths"]) == step["k"] == 4 and sum(step["lengths"]) == step["seq_len"]
    assert step["units"]["loss"] < 1e-5 and step["units"]["grad"] < 1e-5
    assert "whole" not in step  # float32: the reference itself


@pytest.mark.slow  # the dry run: the whole GPU check on a tiny model, about 25 s
def test_dry_run_trains_end_to_end(dry_run):
    """torchrun, one process, torch's 1F1B with pp = 1: the record and TensorBoard's events are there."""
    training = dry_run[1]["training"]
    assert training["status"] == "ok", training.get("output_tail")
    assert training["returncode"] == 0 and training["start_record"]
    assert training["step_records"] == training["steps"] == len(training["losses"]) == 2
    assert training["tensorboard_event_files"]
    assert "-m torchtitan_seq.train" in training["command"] and "1F1B" in training["command"]


@pytest.mark.slow  # the dry run: the whole GPU check on a tiny model, about 25 s
def test_cost_files_load_in_the_simulator(dry_run):
    out, results = dry_run
    for r in results["overhead"]["runs"]:
        schedule = "Seq1F1B" if r["path"] == "units" else "1F1B"
        config = sim.SimConfig(
            schedule, 2, 2, r["k"], cost=str(out / r["cost_file"]), seq_len=r["seq_len"], partition="even"
        )
        result = sim.simulate(config)
        assert result.lengths == r["lengths"]
        assert sim.unit_times(config, result.lengths).F == tuple(r["F"])
        assert result.deadlock is None and result.makespan > 0


def test_without_cuda_it_says_so_in_one_line(tmp_path):
    proc = _run("--out", str(tmp_path / "out"), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: no CUDA device: run on a GPU, or use --device cpu --tiny for the dry run"
    ]
    assert not (tmp_path / "out").exists()
