"""Run ./run_train.sh as a user would and read its step lines."""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:.*memory:\s*([\d.]+)GiB.*tps:\s*([\d,]+)")
_ACT = re.compile(r"step:\s*(\d+)\s+peak activations \(MiB\): (.*)")


@dataclass
class Run:
    returncode: int
    output: str
    losses: list[float] = field(default_factory=list)
    memory_gib: list[float] = field(default_factory=list)
    tps: list[int] = field(default_factory=list)
    activations_mib: list[list[float]] = field(default_factory=list)  # per step, per rank


def run_train(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """./run_train.sh with torchtitan overrides; the job writes under ``dump_folder``."""
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(dump_folder), *overrides],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run = Run(proc.returncode, proc.stdout + proc.stderr)
    for m in _STEP.finditer(run.output):
        run.losses.append(float(m.group(2)))
        run.memory_gib.append(float(m.group(3)))
        run.tps.append(int(m.group(4).replace(",", "")))
    for m in _ACT.finditer(run.output):
        run.activations_mib.append([float(x.split()[1]) for x in m.group(2).split(",")])
    return run


def assert_trained(run: Run, steps: int) -> None:
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.losses) == steps, run.output[-4000:]
    assert all(math.isfinite(x) and x > 0 for x in run.losses), run.losses
    assert all(t > 0 for t in run.tps) and all(m > 0 for m in run.memory_gib)
