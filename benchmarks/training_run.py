"""One training run through ``./run_train.sh`` and its figures, read from the trainer's record,
``<dump_folder>/metrics.jsonl`` (schema: docs/metrics.md), not from the console,
which is kept to show why a run failed. Used by :mod:`bench` and the tests (``tests/helpers/titan.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_seq.titan.metrics import RECORD_FILE

__all__ = ["ROOT", "Run", "read_record", "run_train"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """A training run's exit status, console output and per-step figures (rank 0's record)."""

    returncode: int
    output: str
    losses: list[float] = field(default_factory=list)
    memory_gib: list[float] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    """Wall time of each step: since the previous step's record (step 1: since the start record)."""
    activation_bytes: list[list[int] | None] = field(default_factory=list)
    """Per step, per rank; None on a step not metered (``activation_memory_freq``)."""
    bubble_ratios: list[list[float]] = field(default_factory=list)  # per step, per rank; [] untimed
    pipeline_s: list[float | None] = field(default_factory=list)
    """Per step, the pipeline's makespan (None: stages not timed)."""
    lengths: list[int] | None = None
    """The subsequence lengths of a sequence schedule (None for torch's)."""
    validation_losses: list[float] = field(default_factory=list)

    @property
    def activations_mib(self) -> list[list[float] | None]:
        """``activation_bytes`` in MiB."""
        return [None if step is None else [b / 2**20 for b in step] for step in self.activation_bytes]

    @classmethod
    def from_record(cls, returncode: int, output: str, records: list[dict[str, Any]]) -> Run:
        """The run of ``records`` (:func:`read_record`)."""
        start = next((r for r in records if r["event"] == "start"), None)
        steps = [r for r in records if r["event"] == "step"]
        times = ([start["time"]] if start else []) + [r["time"] for r in steps]
        return cls(
            returncode,
            output,
            losses=[r["loss"] for r in steps],
            memory_gib=[r["memory_gib"] for r in steps],
            tps=[r["tps"] for r in steps],
            step_times_s=[b - a for a, b in zip(times, times[1:])],
            activation_bytes=[r["peak_activation_bytes"] for r in steps],
            bubble_ratios=[r["bubble_ratio"] for r in steps],
            pipeline_s=[r["pipeline_s"] for r in steps],
            lengths=start["lengths"] if start else None,
            validation_losses=[r["loss"] for r in records if r["event"] == "validation"],
        )


def read_record(path: Path) -> list[dict[str, Any]]:
    """The latest run's records in a ``metrics.jsonl``: from its last start record on
    (a dump folder used again appends); [] when there is no file (the job never started)."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    return records[starts[-1] :] if starts else records


def run_train(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """``./run_train.sh`` with torchtitan overrides; the job writes under ``dump_folder``."""
    script = ROOT / "run_train.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the benchmark runs from the source checkout")
    dump_folder = Path(dump_folder).resolve()  # the job runs in ROOT, the caller maybe elsewhere
    proc = subprocess.run(
        [str(script), "--job.dump_folder", str(dump_folder), *overrides],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run.from_record(proc.returncode, proc.stdout + proc.stderr, read_record(dump_folder / RECORD_FILE))
