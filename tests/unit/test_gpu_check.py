"""The prepared GPU check (benchmarks/gpu_check.py) through its CPU dry run.

The dry run goes through the same code as a GPU run, at toy sizes, so the script
cannot rot between GPU runs: its figures must be there and sane, and the cost
files it writes must load in the simulator.
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
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--device", "cpu", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "gpu_check.json").read_text())


def test_dry_run_reports_every_figure(dry_run):
    _, results = dry_run
    for key in ("date", "device", "torch", "cuda", "flash_attn", "attention", "overhead", "elapsed_s"):
        assert key in results, key
    cases = results["attention"]["cases"]
    assert {(c["mask"], c["status"]) for c in cases} == {("causal", "ok"), ("block_causal", "ok")}
    tolerance = {"float32": 1e-5, "float16": 5e-2, "bfloat16": 5e-2}
    assert {c["dtype"] for c in cases if c["mask"] == "causal"} == set(tolerance)
    for case in cases:
        for cut, errors in case.get("errors", {}).items():
            assert set(errors) == {"out", "dq", "dk", "dv"}
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
