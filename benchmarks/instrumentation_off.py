"""What instrumentation costs a step that reports nothing: the off path, timed per call.

A step that neither meters activations nor records its timeline still passes through the
instrumentation's switches: the trainer's per-step decision (``meters_activations``,
``should_log``), the meter's ``nullcontext`` and, per compute action, the disabled
recorder's ``RECORDER.action`` context (:mod:`torchtitan_seq.instrumentation.timeline`). A build without
the meter would run none of them, so their cost is the whole difference between such a step
and that build. On a shared 2-core machine step times move by several percent from run to
run, far more than this difference, so it is measured directly: each switch timed alone
(median of repeats of many calls), times the number of calls a step makes (the compute
actions of each rank's list, from the schedule itself), against the step time that
``bench.py`` measured.

    python benchmarks/instrumentation_off.py --bench benchmarks/instrumentation/bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import timeit
from pathlib import Path

from torch.distributed.pipelining.schedules import _ComputationType

from torchtitan_seq.instrumentation.timeline import StepTimeline
from torchtitan_seq.simulate.build import SimConfig, build

F = _ComputationType.FORWARD


def _per_call_s(stmt, number: int = 200_000, repeat: int = 7) -> float:
    """Median seconds per call of ``stmt`` over ``repeat`` runs of ``number`` calls."""
    return statistics.median(timeit.repeat(stmt, number=number, repeat=repeat)) / number


def off_path_costs() -> dict[str, float]:
    """Seconds per call of each switch a step without instrumentation passes through."""
    recorder = StepTimeline()  # disabled, as on every step that is not logged

    def action() -> None:
        with recorder.action(0, F, 0):
            pass

    def meter() -> None:  # the trainer's forward_backward_step on a step that does not meter
        with contextlib.nullcontext():
            pass

    def bare() -> None:  # what a build without instrumentation runs in their place
        pass

    base = _per_call_s(bare)
    return {
        "action_s": _per_call_s(action) - base,
        "step_switches_s": _per_call_s(meter) - base + _per_call_s(recorder.start_step) - base,
    }


def compute_actions(schedule: str, pp: int, microbatches: int, k: int) -> int:
    """Compute actions in the busiest rank's list of one step."""
    order = build(SimConfig(schedule=schedule, pp=pp, microbatches=microbatches, subsequences=k)).order
    return max(sum(a is not None for a in acts) for acts in order.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="bench.py's JSON (step times of the shapes)")
    ap.add_argument("--out", type=Path, help="write the table here (markdown)")
    args = ap.parse_args()
    costs = off_path_costs()
    rows = [
        "| schedule | seq | actions per step (busiest rank) | off path per step (us) | step time (s) "
        "| share of the step |",
        "|---|---|---|---|---|---|",
    ]
    for r in json.loads(args.bench.read_text()):
        if not r.get("instrumented", True):
            continue
        n_actions = compute_actions(r["schedule"], r["pp"], r["microbatches"], r["num_subsequences"])
        off_s = n_actions * costs["action_s"] + costs["step_switches_s"]
        rows.append(
            f"| {r['label']} | {r['seq_len']} | {n_actions} | {off_s * 1e6:.1f} | {r['step_time_s']:.3f} "
            f"| {off_s / r['step_time_s']:.2e} |"
        )
    table = "\n".join(
        [
            f"Disabled recorder: {costs['action_s'] * 1e9:.0f} ns per action; per-step switches: "
            f"{costs['step_switches_s'] * 1e9:.0f} ns.",
            "",
            *rows,
        ]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
