"""The trainer's structured record read back: a training run's figures from ``metrics.jsonl``.

Rank 0 of a training job appends one JSON object a line to ``<dump_folder>/metrics.jsonl``
(:data:`RECORD_FILE`; written by :class:`torchtitan_seq.titan.metrics.MetricsRecord`, schema in
docs/metrics.md): a start record, a record per logged step and per validation. :func:`read_record`
reads the latest run's records, and :class:`Run` holds the figures a program compares across runs
(losses, step times, peak activation bytes and bubble ratios per rank, the subsequence lengths),
with the exit status and console output of whatever launched the job.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RECORD_FILE", "Run", "read_record", "run_job"]

RECORD_FILE = "metrics.jsonl"
"""The structured record's file name in the job's dump folder."""


def read_record(path: Path) -> list[dict[str, Any]]:
    """The latest run's records in a ``metrics.jsonl``.

    Args:
        path: the record file (``<dump_folder>/metrics.jsonl``).

    Returns:
        The records from the file's last start record on (a dump folder used again appends another
        run's); every record when there is no start record; ``[]`` when there is no file (the job
        never started).
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    return records[starts[-1] :] if starts else records


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
    kv_bytes: list[list[int] | None] = field(default_factory=list)
    """Per step, per rank, the K/V context's peak bytes; None on a step not metered or under torch's schedules."""
    bubble_ratios: list[list[float]] = field(default_factory=list)
    """Per step, per rank; ``[]`` on a step whose stages were not timed."""
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
        """The run that ``records`` describe.

        Args:
            returncode: the exit status of the job's launcher.
            output: its console output, kept to show why a run failed.
            records: one run's records, as :func:`read_record` returns them.

        Returns:
            The run's figures, step by step.
        """
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
            kv_bytes=[r.get("peak_kv_bytes") for r in steps],
            bubble_ratios=[r["bubble_ratio"] for r in steps],
            pipeline_s=[r["pipeline_s"] for r in steps],
            lengths=start["lengths"] if start else None,
            validation_losses=[r["loss"] for r in records if r["event"] == "validation"],
        )

    @classmethod
    def from_dump_folder(cls, dump_folder: Path, returncode: int = 0, output: str = "") -> Run:
        """The latest run recorded in a job's dump folder.

        Args:
            dump_folder: the job's ``--job.dump_folder``.
            returncode: the exit status of the job's launcher.
            output: its console output.

        Returns:
            The run of ``<dump_folder>/metrics.jsonl``'s latest records; no steps when there is no record.
        """
        return cls.from_record(returncode, output, read_record(Path(dump_folder) / RECORD_FILE))


def run_job(command: list[str], dump_folder: Path, *, cwd: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """Run a training job's command line and read its run from its record.

    Args:
        command: the command (e.g. ``./run_train.sh`` and torchtitan overrides), to which
            ``--job.dump_folder <dump_folder>`` is added.
        dump_folder: where the job writes its record.
        cwd: the directory the command runs in.
        env: variables set for the job, over this process's environment.
        timeout: seconds before the job is killed (``subprocess.TimeoutExpired``).

    Returns:
        The job's exit status, console output and figures (:meth:`Run.from_dump_folder`).
    """
    dump_folder = Path(dump_folder).resolve()  # the job runs in cwd, the caller maybe elsewhere
    proc = subprocess.run(
        [*command, "--job.dump_folder", str(dump_folder)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run.from_dump_folder(dump_folder, proc.returncode, proc.stdout + proc.stderr)
