"""The planner against a measured benchmark: ranking and activation peaks.

    python benchmarks/bench.py --schedules 1F1B,Interleaved1F1B,Seq1F1B:2:even,... \\
        --seq-lens 2048 --calibrate --out benchmarks/planner
    python benchmarks/planner_check.py benchmarks/planner

For every configuration the benchmark ran (debug model, pp=2, the CPU), the
planner's prediction (:func:`torchtitan_seq.plan.evaluate`, with the
benchmark's calibration files as ``--cost``) is set beside the measurement:
tokens/s and its rank, and each rank's activation peak (the memory model's
activations plus KV context, against the saved-tensor peak the benchmark
measures). Writes ``planner_check.md`` into the folder and prints it. Exit
status 1 when they disagree: the rankings by more than :data:`ALLOWED_SWAPS`
adjacent swap, or a peak by more than :data:`PEAK_TOLERANCE`
(``tests/unit/test_plan.py`` runs it on the committed run).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from torchtitan_seq.plan import Cluster, Job, ScheduleChoice, evaluate, memory
from torchtitan_seq.simulate import SimConfig
from torchtitan_seq.simulate.build import build

__all__ = ["ALLOWED_SWAPS", "PEAK_TOLERANCE", "Row", "compare", "check", "main"]

ALLOWED_SWAPS = 1
"""Adjacent swaps between the measured and the predicted ranking that still agree (close neighbours
swap on a machine whose speed drifts)."""
PEAK_TOLERANCE = 0.10
"""The largest relative error of a predicted activation peak that still agrees."""


@dataclass(frozen=True)
class Row:
    label: str
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    measured_peaks: tuple[float, ...]
    """Per rank, bytes."""
    step_times: tuple[float, ...]
    """Every measured step, seconds."""
    predicted_peaks: tuple[float, ...]

    @property
    def peak_errors(self) -> tuple[float, ...]:
        return tuple(p / m - 1 for p, m in zip(self.predicted_peaks, self.measured_peaks))


def compare(folder: Path) -> list[Row]:
    """One row per configuration of the benchmark in ``folder`` (its first sequence length)."""
    records = json.loads((folder / "bench.json").read_text())
    seq_len = records[0]["seq_len"]
    records = [r for r in records if r["seq_len"] == seq_len and not r.get("compiled")]
    costs = tuple(sorted(folder.glob(f"cost_s{seq_len}_*.json")))
    rows = []
    for r in records:
        name, k = r["schedule"], r["num_subsequences"]
        v = build(SimConfig(name, r["pp"], r["microbatches"], k)).stages_per_rank  # the schedule's own
        choice = ScheduleChoice(name, k, r["partition"] or "even", v)
        # The benchmark's runs cut as train_configs/debug_model.toml does: length_multiple 64.
        job = Job("debugmodel", seq_len, r["microbatches"], 1, costs, length_multiple=64)
        cluster = Cluster(r["pp"], 1e9, device="cpu")
        predicted = evaluate(job, cluster, choice, r["pp"])
        ranks = memory(job, cluster, choice, r["pp"], 1, "none").ranks
        rows.append(
            Row(
                r["label"],
                r["tokens_per_s"],
                predicted.tokens_per_s,
                tuple(r["peak_activation_bytes"]),
                tuple(r["step_times_s"]),
                tuple(m.activations + m.kv_context for m in ranks),
            )
        )
    return rows


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return [order.index(i) + 1 for i in range(len(values))]


def check(rows: list[Row]) -> tuple[int, float]:
    """(adjacent swaps between the measured and predicted rankings, largest peak error)."""
    measured = sorted(range(len(rows)), key=lambda i: -rows[i].measured_tokens_per_s)
    predicted = sorted(range(len(rows)), key=lambda i: -rows[i].predicted_tokens_per_s)
    position = {row: i for i, row in enumerate(measured)}
    sequence = [position[i] for i in predicted]
    swaps = sum(a > b for i, a in enumerate(sequence) for b in sequence[i + 1 :])  # inversions
    return swaps, max(abs(e) for row in rows for e in row.peak_errors)


def main(argv: list[str] | None = None) -> int:
    folder = Path((argv or sys.argv[1:] or [str(Path(__file__).parent / "planner")])[0])
    rows = compare(folder)
    measured = _ranks([r.measured_tokens_per_s for r in rows])
    predicted = _ranks([r.predicted_tokens_per_s for r in rows])
    swaps, worst = check(rows)
    lines = [
        "# The planner against the benchmark",
        "",
        f"`python benchmarks/planner_check.py {folder}`: debug model, pp=2, CPU; the planner with the "
        "benchmark's calibration files. Peaks: activations + KV context per rank.",
        "",
        "| configuration | measured tokens/s | rank | predicted tokens/s | rank | measured peaks (MiB) "
        "| predicted peaks (MiB) | peak error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, m, p in zip(rows, measured, predicted):
        lines.append(
            f"| {row.label} | {row.measured_tokens_per_s:.0f} | {m} | {row.predicted_tokens_per_s:.0f} | {p} | "
            + ", ".join(f"{b / 2**20:.1f}" for b in row.measured_peaks)
            + " | "
            + ", ".join(f"{b / 2**20:.1f}" for b in row.predicted_peaks)
            + " | "
            + ", ".join(f"{e:+.1%}" for e in row.peak_errors)
            + " |"
        )
    spread = max(max(r.step_times) / min(r.step_times) - 1 for r in rows)
    errors = [r.predicted_tokens_per_s / r.measured_tokens_per_s - 1 for r in rows]
    verdict = (
        "agree up to one adjacent swap"
        if swaps <= ALLOWED_SWAPS
        else f"do not agree: {swaps} adjacent swaps, {ALLOWED_SWAPS} allowed"
    )
    lines += [
        "",
        f"Adjacent swaps between the rankings: {swaps}. Largest peak error: {worst:.1%}. Predicted "
        f"tokens/s against measured: {min(errors):+.1%} to {max(errors):+.1%}. Largest spread of one "
        f"configuration's measured steps (max / min - 1): {spread:.0%}.",
        "",
        "Peaks are the memory model's (activations + KV context). Throughput is the simulator's on the "
        "benchmark's calibration: every stage timed as its own model chunk on its rank, calibrated in "
        "every round beside the runs and merged over the rounds (median). The rankings "
        f"{verdict}.",
    ]
    text = "\n".join(lines) + "\n"
    (folder / "planner_check.md").write_text(text)
    print(text)
    if worst > PEAK_TOLERANCE:
        print(f"error: a predicted peak is {worst:.1%} off, more than {PEAK_TOLERANCE:.0%}", file=sys.stderr)
    return 0 if swaps <= ALLOWED_SWAPS and worst <= PEAK_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
