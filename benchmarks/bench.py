"""Benchmark of pipeline schedules on real training steps.

Usage, from the source checkout (each run is its ``./run_train.sh``)::

    python benchmarks/bench.py --schedules 1F1B,Seq1F1B,Seq1F1B:8:even \\
        --seq-lens 2048,4096 --steps 4 --rounds 2 --out bench_out [--calibrate]

Not part of the installed package: it imports :mod:`training_run` (a run
through ``./run_train.sh``, read back with :mod:`torchtitan_seq.instrumentation.record`)
and :mod:`calibration` beside it (``benchmarks/``, the script's own folder, is on
``sys.path``), and the checkout's ``torchtitan_seq``.

A schedule is ``NAME[:K[:PARTITION]]``: a sequence schedule's k and partition
default to ``--subsequences`` and ``--partition``; torch's schedules (1F1B,
Interleaved1F1B, GPipe, ...) run whole microbatches. Every run trains the
job of ``--config`` (default: the Llama 3 debug model) through
``./run_train.sh`` with overrides, the code path of training itself, on
``--pp`` ranks with ``--microbatches`` microbatches of one sequence. For each
length the schedules alternate run by run (A B C A B C ...) for ``--rounds``
rounds, so that drift in the machine's speed spreads over all of them.
``--dry-run`` prints each run's command, and what the job check refuses,
without running anything.

What is measured, per schedule and length, over the steps of all rounds
after the first ``--warmup`` of each run, all of it read from the trainer's
structured record, ``metrics.jsonl`` in the run's dump folder
(:mod:`torchtitan_seq.titan.metrics`), as rank 0 writes it:

* step time: the median wall time between consecutive step records
  (``time.time()`` stamps): a whole training step, pipeline, optimizer and
  logging.
* tokens/s: the pipeline's tokens per step (microbatches x sequence length)
  over that median. torchtitan's tps is this divided by the ranks.
* peak activation bytes per rank: the largest of the steps, as the trainer
  measures it (bytes autograd keeps for backward, :mod:`torchtitan_seq.instrumentation.memory`);
  the benchmark meters every step (``activation_memory_freq = 1``).
* bubble ratio per rank and pipeline time: the median over the steps, as
  the trainer measures them (:mod:`torchtitan_seq.instrumentation.timeline`; the pipeline time
  is the makespan of the schedule's compute, without optimizer and logging);
  None for torch's schedules, whose stages are not timed.
* ratios of tokens/s and of rank 0's peak to 1F1B's at the same length,
  compiled runs against compiled 1F1B (``--compile on|both``), eager against eager.
* the first step apart (median over the runs): it compiles, so its excess over
  the median step is the compile time.
* ``--instrumentation both``: every schedule also runs with the trainer's
  instrumentation off (no activation meter, no timeline), alternating with the
  instrumented runs; the instrumented record gets the ratio of its step time to
  the uninstrumented one's, the instrumentation's cost.

``--calibrate`` also times the passes of every unit on every pipeline
rank, each rank in its own process (one thread, like a training rank) and
all at once, as the ranks share the machine, at each run's subsequence
lengths and with the model chunks the run's schedule puts on each rank
(:func:`chunks_of_ranks`; a rank of several chunks alternates between them,
:func:`calibration.calibrate`). It does so in every round, right after the
first run that needs those units, so that on a shared machine whose speed
drifts the calibrations sample the same minutes as the runs; the median over
the rounds (:func:`calibration.merge`) is written as a cost file of
:mod:`torchtitan_seq.simulate` (seconds; every chunk's times on its rank) in
``--out``, and each record gets the simulator's predicted step time
(makespan of the pipeline alone, no optimizer, no communication time) and its
error against the measured step and against the measured pipeline time, and
what a unit costs beyond its share (:func:`add_unit_fit`): a fixed cost per unit
fitted to every calibrated unit of the length, and its share of the cut's
compute, shown beside the tokens/s ratio (a large share: k too large for the
machine).

Outputs in ``--out``: ``bench.json`` (a list of records, see :class:`Record`),
``bench.md`` (a table) and ``bench.png`` (tokens/s and rank 0's peak against
the length, one line per schedule; needs matplotlib, the ``bench`` extra),
and under ``runs/`` each run's dump folder with its ``metrics.jsonl`` and its
console output, ``train.log``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# The checkout's package, the one ./run_train.sh trains, whichever one is installed.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from calibration import calibrate, merge  # noqa: E402
from torchtitan_seq.instrumentation.record import Run  # noqa: E402
from torchtitan_seq.runtime.partition import PARTITIONS  # noqa: E402
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES  # noqa: E402
from torchtitan_seq.schedules.ordering import compute_leaves  # noqa: E402
from torchtitan_seq.simulate import SimConfig, simulate  # noqa: E402
from torchtitan_seq.simulate.build import build  # noqa: E402
from torchtitan_seq.simulate.costs import fit_cost_files  # noqa: E402
from training_run import ROOT, run_train  # noqa: E402

__all__ = [
    "Variant",
    "parse_variants",
    "Record",
    "refusals",
    "dry_run",
    "measure",
    "chunks_of_ranks",
    "predicted_step_time",
    "calibrate_run",
    "add_predictions",
    "add_unit_fit",
    "main",
]

BASELINE = "1F1B"

# --------------------------------------------------------------------------
# What runs


@dataclass(frozen=True)
class Variant:
    """A schedule with its sequence cut (k = 1 and no partition for torch's schedules)."""

    schedule: str
    num_subsequences: int = 1
    partition: str | None = None
    compiled: bool = False
    """torchtitan's per-block torch.compile (``--compile.enable``)."""
    instrumented: bool = True
    """The trainer meters activations and times actions on every step; False: on none."""

    @property
    def is_sequence(self) -> bool:
        return self.schedule in SEQUENCE_SCHEDULES

    @property
    def label(self) -> str:
        label = f"{self.schedule} k={self.num_subsequences} {self.partition}" if self.is_sequence else self.schedule
        return label + (" compiled" if self.compiled else "") + ("" if self.instrumented else " uninstrumented")

    def overrides(self) -> list[str]:
        out = ["--parallelism.pipeline_parallel_schedule", self.schedule]
        if self.is_sequence:
            out += [
                "--sequence_pipeline.num_subsequences",
                str(self.num_subsequences),
                "--sequence_pipeline.partition",
                str(self.partition),
            ]
        if self.compiled:
            out.append("--compile.enable")
        if self.instrumented:
            out += ["--sequence_pipeline.activation_memory_freq", "1"]  # and the timeline on every logged step
        else:
            out += ["--sequence_pipeline.activation_memory_freq", "0", "--sequence_pipeline.no-pipeline-timeline"]
        return out


def parse_variants(
    spec: str, subsequences: int, partition: str, compile: str = "off", instrumentation: str = "on"
) -> list[Variant]:
    """``"1F1B,Seq1F1B,Seq1F1B:8:even"`` -> variants; k and partition default to the given ones.
    ``compile``: ``"off"``, ``"on"``, or ``"both"`` (each schedule eager, then compiled);
    ``instrumentation`` likewise (``"both"``: each instrumented, then not). A ValueError names
    every item that is not a schedule spec."""
    variants, errors = [], []
    for item in spec.split(","):
        name, *rest = item.strip().split(":")
        if name not in SEQUENCE_SCHEDULES:
            if rest:
                errors.append(f"{item!r}: {name} is torch's schedule, it takes no k or partition")
            variants.append(Variant(name))
            continue
        if len(rest) > 2 or (rest and not rest[0].isdigit()):
            errors.append(f"{item!r}: use NAME[:K[:PARTITION]], K a whole number")
            continue
        part = rest[1] if len(rest) > 1 else partition
        if part not in PARTITIONS:
            errors.append(f"{item!r}: partition {part!r} is not one of {PARTITIONS}")
        variants.append(Variant(name, int(rest[0]) if rest else subsequences, part))
    if errors:
        raise ValueError("; ".join(errors))
    modes = {"off": (False,), "on": (True,), "both": (False, True)}
    return [
        dataclasses.replace(v, compiled=c, instrumented=i)
        for v in variants
        for c in modes[compile]
        for i in reversed(modes[instrumentation])
    ]


@dataclass
class Record:
    """One schedule at one length: what ``bench.json`` holds."""

    schedule: str
    label: str
    compiled: bool
    seq_len: int
    num_subsequences: int
    partition: str | None
    lengths: list[int]
    pp: int
    microbatches: int
    steps_measured: int
    step_times_s: list[float]
    step_time_s: float
    """Median of ``step_times_s``."""
    tokens_per_s: float
    peak_activation_bytes: list[int] | None
    """Per rank, the largest of the measured steps; None when none was metered (uninstrumented)."""
    bubble_ratio: list[float] | None
    """Per rank, median of the measured steps; None when the stages are not timed."""
    pipeline_time_s: float | None
    """Median makespan of the pipeline's compute; None when the stages are not timed."""
    first_step_s: float
    """Median over the runs of the first step, which compiles (compiled runs) and warms up."""
    tokens_per_s_ratio: float | None = None
    """tokens/s over 1F1B's at the same length, compiled against compiled, eager against
    eager (None without such a 1F1B run)."""
    peak_activation_ratio: float | None = None
    """Rank 0's peak over that 1F1B's."""
    cost_file: str | None = None
    predicted_step_time_s: float | None = None
    """The simulator's makespan under ``cost_file`` (``--calibrate``)."""
    prediction_error: float | None = None
    """predicted / measured step time - 1."""
    pipeline_prediction_error: float | None = None
    """predicted / measured pipeline time - 1."""
    unit_fit: dict[str, float] | None = None
    """``--calibrate``: every unit's F + B at this length fitted as ``fixed_s`` per unit plus
    ``per_token_s`` per token and ``per_pair_s`` per causal (query, key) pair, all cuts together
    (:func:`add_unit_fit`)."""
    fixed_cost_share: float | None = None
    """k x fixed over this cut's fitted F + B: the share of each stage's compute that is the
    fixed cost per unit (:meth:`~torchtitan_seq.simulate.costs.UnitCostFit.fixed_share`)."""
    instrumented: bool = True
    instrumentation_cost: float | None = None
    """Step time over that of the same schedule run uninstrumented, - 1 (``--instrumentation both``)."""


def _job_overrides(variant: Variant, seq_len: int, args: argparse.Namespace) -> list[str]:
    return [
        *variant.overrides(),
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(args.microbatches),
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--parallelism.pipeline_parallel_degree",
        str(args.pp),
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        "1",
    ]


def _check_run(run: Run, steps: int, what: str) -> None:
    """Fail unless every step was logged. A run that fails after its last step (seen once: a
    rank aborting with SIGABRT at shutdown) still measured every step: it is kept, with a warning."""
    if len(run.step_times_s) != steps:
        raise RuntimeError(f"{what} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    if run.returncode != 0:
        print(f"warning: {what} exited with {run.returncode} after its last step", file=sys.stderr)


def refusals(variants: list[Variant], args: argparse.Namespace) -> dict[tuple[Variant, int], str]:
    """Per (variant, length) that the job check refuses on ``args.pp`` processes, its one-line message,
    checked in this process before any run: those are left out, the others measured (a schedule that
    cannot run here, e.g. DualPipeV on a CPU, does not stop the benchmark)."""
    from torchtitan.config import ConfigManager

    from torchtitan_seq.titan.v022.job_check import check_job
    from torchtitan_seq.titan.v022.registration import register
    from torchtitan_seq.train import resolve_args

    register()
    out = {}
    for seq_len in args.seq_lens:
        for v in variants:
            argv = ["--job.config_file", str(Path(args.config).resolve()), *_job_overrides(v, seq_len, args)]
            try:
                check_job(ConfigManager().parse_args(resolve_args(argv)), args.pp)
            except (ValueError, FileNotFoundError) as e:
                out[v, seq_len] = str(e)
    return out


def dry_run(variants: list[Variant], args: argparse.Namespace, refused: dict[tuple[Variant, int], str]) -> str:
    """``--dry-run``: the runs of one round at each length, in the order :func:`measure` runs them,
    each as its ``./run_train.sh`` command; nothing runs."""
    lines = [f"{args.rounds} round(s) of these runs, alternating (--dry-run: nothing runs):"]
    for seq_len in args.seq_lens:
        for v in variants:
            if (v, seq_len) not in refused:
                overrides = " ".join(_job_overrides(v, seq_len, args))
                lines.append(
                    f"seq {seq_len}, {v.label}: NGPU={args.pp} CONFIG_FILE={args.config} ./run_train.sh {overrides}"
                )
    return "\n".join(lines)


def measure(
    variants: list[Variant], args: argparse.Namespace, refused: dict[tuple[Variant, int], str] | None = None
) -> list[Record]:
    """Run every variant ``args.rounds`` times at each length, alternating; one record each, none for
    the (variant, length) pairs in ``refused`` (:func:`refusals`).
    With ``--calibrate``, each round also calibrates every run's units (:func:`calibrate_run`)
    right after the first run that needs them, and the records get the simulator's predictions."""
    env = {"NGPU": str(args.pp), "CONFIG_FILE": str(Path(args.config).resolve())}
    refused = refused or {}
    total = (len(args.seq_lens) * len(variants) - len(refused)) * args.rounds
    records = []
    count = 0
    for seq_len in args.seq_lens:
        runnable = [v for v in variants if (v, seq_len) not in refused]
        runs: dict[Variant, list[Run]] = {v: [] for v in runnable}
        calibrations: dict[tuple, list[dict]] = {}
        for r in range(args.rounds):
            for v in runnable:
                count += 1
                what = f"[{count}/{total}] seq {seq_len} round {r + 1}/{args.rounds} {v.label}"
                began = time.monotonic()
                folder = args.out / "runs" / f"{v.label.replace(' ', '_').replace('=', '')}_s{seq_len}_r{r}"
                run = run_train(*_job_overrides(v, seq_len, args), dump_folder=folder, env=env)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "train.log").write_text(run.output)
                _check_run(run, args.steps, what)
                runs[v].append(run)
                kept = run.step_times_s[args.warmup :]
                peaks = [b[0] for b in run.activation_bytes if b]
                peak = f", peak rank 0 {max(peaks) / 2**20:.1f} MiB" if peaks else ""
                print(
                    f"{what}: median step {statistics.median(kept):.3f} s{peak} ({time.monotonic() - began:.0f} s)",
                    flush=True,
                )
                if args.calibrate:
                    calibrate_run(v, seq_len, run.lengths or [seq_len], args, calibrations, r)
        mine = [_record(v, seq_len, runs[v], args) for v in runnable]
        if args.calibrate:
            add_predictions(mine, calibrations, args)
        records += mine
    _add_ratios(records)
    return records


def _record(variant: Variant, seq_len: int, runs: list[Run], args: argparse.Namespace) -> Record:
    keep = slice(args.warmup, None)
    times = [t for run in runs for t in run.step_times_s[keep]]
    peaks = [b for run in runs for b in run.activation_bytes[keep] if b]
    bubbles = [b for run in runs for b in run.bubble_ratios[keep] if b]
    pipeline = [t for run in runs for t in run.pipeline_s[keep] if t is not None]
    median = statistics.median(times)
    return Record(
        schedule=variant.schedule,
        label=variant.label,
        compiled=variant.compiled,
        instrumented=variant.instrumented,
        seq_len=seq_len,
        num_subsequences=variant.num_subsequences,
        partition=variant.partition,
        lengths=runs[0].lengths or [seq_len],
        pp=args.pp,
        microbatches=args.microbatches,
        steps_measured=len(times),
        step_times_s=times,
        step_time_s=median,
        tokens_per_s=args.microbatches * seq_len / median,
        peak_activation_bytes=[max(step[r] for step in peaks) for r in range(len(peaks[0]))] if peaks else None,
        bubble_ratio=[statistics.median(step[r] for step in bubbles) for r in range(len(bubbles[0]))]
        if bubbles
        else None,
        pipeline_time_s=statistics.median(pipeline) if pipeline else None,
        first_step_s=statistics.median(run.step_times_s[0] for run in runs),
    )


def _add_ratios(records: list[Record]) -> None:
    base = {(r.seq_len, r.compiled, r.instrumented): r for r in records if r.schedule == BASELINE}
    bare = {(r.label, r.seq_len): r for r in records if not r.instrumented}
    for r in records:
        b = base.get((r.seq_len, r.compiled, r.instrumented))
        if b is not None:
            r.tokens_per_s_ratio = r.tokens_per_s / b.tokens_per_s
            if r.peak_activation_bytes and b.peak_activation_bytes:
                r.peak_activation_ratio = r.peak_activation_bytes[0] / b.peak_activation_bytes[0]
        off = bare.get((r.label + " uninstrumented", r.seq_len))
        if off is not None:
            r.instrumentation_cost = r.step_time_s / off.step_time_s - 1


# --------------------------------------------------------------------------
# Predictions: the simulator under calibrated unit times (calibration.py)


def predicted_step_time(record: Record, cost_file: Path) -> float:
    """The simulator's makespan of ``record``'s schedule under the measured costs, in seconds."""
    result = simulate(
        SimConfig(
            schedule=record.schedule,
            pp=record.pp,
            microbatches=record.microbatches,
            subsequences=record.num_subsequences,
            cost=str(cost_file),
            seq_len=record.seq_len,
            partition=record.partition or "even",
        )
    )
    if result.deadlock:
        raise RuntimeError(f"{record.label}: {result.deadlock.describe()}")
    return result.makespan


def chunks_of_ranks(schedule: str, pp: int, microbatches: int, k: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the model chunks its stages run (stage index modulo the chain length)."""
    built = build(SimConfig(schedule, pp, microbatches, k))
    chain = pp * built.stages_per_rank // built.parameter_copies
    return tuple(
        tuple(sorted({leaf.stage_index % chain for a in built.order[q] if a for leaf in compute_leaves(a)}))
        for q in range(pp)
    )


def _cost_key(
    schedule: str, num_subsequences: int, seq_len: int, lengths: list[int], args: argparse.Namespace
) -> tuple:
    """What a calibration depends on: length, cut, units or whole sequences, each rank's chunks."""
    chunks = chunks_of_ranks(schedule, args.pp, args.microbatches, num_subsequences)
    return seq_len, tuple(lengths), schedule in SEQUENCE_SCHEDULES, chunks


def calibrate_run(
    variant: Variant,
    seq_len: int,
    lengths: list[int],
    args: argparse.Namespace,
    calibrations: dict[tuple, list[dict]],
    round_index: int,
) -> None:
    """Calibrate ``variant``'s units unless this round already did: once per round, right after
    a run, so that calibrations and runs sample the machine's drifting speed alike."""
    key = _cost_key(variant.schedule, variant.num_subsequences, seq_len, lengths, args)
    done = calibrations.setdefault(key, [])
    if len(done) > round_index:
        return
    began = time.monotonic()
    done.append(
        calibrate(seq_len, lengths, args.pp, units=key[2], chunks=[list(c) for c in key[3]], repeats=args.repeats)
    )
    print(f"calibrated {_cost_name(key)} ({time.monotonic() - began:.0f} s)", flush=True)


def _cost_name(key: tuple) -> str:
    seq_len, lengths, units, chunks = key
    layout = (
        ""
        if chunks == tuple((q,) for q in range(len(chunks)))
        else "_chunks-" + "-".join(".".join(map(str, c)) for c in chunks)
    )
    return f"cost_s{seq_len}_{'units' if units else 'whole'}_{'-'.join(map(str, lengths))}{layout}.json"


def add_predictions(records: list[Record], calibrations: dict[tuple, list[dict]], args: argparse.Namespace) -> None:
    """Write each cut's calibrations, merged over the rounds, as a cost file in ``--out``, and
    record the simulator's prediction for every record."""
    paths: dict[tuple, Path] = {}
    for r in records:
        key = _cost_key(r.schedule, r.num_subsequences, r.seq_len, r.lengths, args)
        if key not in paths:  # records of one cut and layout share their file
            paths[key] = args.out / _cost_name(key)
            paths[key].write_text(json.dumps(merge(calibrations[key]), indent=1) + "\n")
        path = paths[key]
        r.cost_file = path.name
        r.predicted_step_time_s = predicted_step_time(r, path)
        r.prediction_error = r.predicted_step_time_s / r.step_time_s - 1
        if r.pipeline_time_s is not None:
            r.pipeline_prediction_error = r.predicted_step_time_s / r.pipeline_time_s - 1
    add_unit_fit(records, list(paths.values()))


def add_unit_fit(records: list[Record], paths: list[Path]) -> None:
    """What a unit costs beyond its share: the fit of every calibrated unit of one length (all
    cuts together: one cut alone cannot tell a fixed cost from a cost per token) to a fixed cost
    per unit plus costs per token and per causal (query, key) pair
    (:func:`torchtitan_seq.simulate.costs.fit_cost_files`), written into each cost file with
    its cut's fixed share, and each record's share. No fit (a warning) when the cuts cannot
    separate the terms."""
    try:
        fit = fit_cost_files(paths)
    except ValueError as e:
        print(f"no unit-cost fit: {e}", file=sys.stderr)
        return
    terms = {"fixed_s": fit.fixed, "per_token_s": fit.per_token, "per_pair_s": fit.per_pair}
    for path in paths:
        data = json.loads(path.read_text())
        data.update(unit_fit=terms, fixed_share=fit.fixed_share(data["lengths"]))
        path.write_text(json.dumps(data, indent=1) + "\n")
    for r in records:
        r.unit_fit, r.fixed_cost_share = terms, fit.fixed_share(r.lengths)


# --------------------------------------------------------------------------
# Reports


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def write_markdown(records: list[Record], path: Path, header: str) -> None:
    rows = [
        "| schedule | seq | lengths | step time (s) | tokens/s | x 1F1B | fixed cost share "
        "| peak act. rank 0 (MiB) | x 1F1B "
        "| peak act. per rank (MiB) | bubble ratio per rank | pipeline (s) | first step (s) | predicted (s) "
        "| error vs step | vs pipeline | instrumentation cost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        mib = [b / 2**20 for b in r.peak_activation_bytes or []]
        bubbles = ", ".join(f"{b:.3f}" for b in r.bubble_ratio) if r.bubble_ratio else ""
        rows.append(
            f"| {r.label} | {r.seq_len} | {r.lengths} | {r.step_time_s:.3f} | {r.tokens_per_s:.0f} "
            f"| {_fmt(r.tokens_per_s_ratio, '.3f')} | {_fmt(r.fixed_cost_share, '.1%')} "
            f"| {_fmt(mib[0] if mib else None, '.1f')} "
            f"| {_fmt(r.peak_activation_ratio, '.3f')} | {', '.join(f'{b:.1f}' for b in mib)} | {bubbles} "
            f"| {_fmt(r.pipeline_time_s, '.3f')} | {r.first_step_s:.1f} | {_fmt(r.predicted_step_time_s, '.3f')} "
            f"| {_fmt(r.prediction_error, '+.1%')} | {_fmt(r.pipeline_prediction_error, '+.1%')} "
            f"| {_fmt(r.instrumentation_cost, '+.1%')} |"
        )
    path.write_text(header + "\n\n" + "\n".join(rows) + "\n")


def write_plot(records: list[Record], path: Path) -> None:
    """tokens/s and rank 0's peak activations against the length, one line per schedule."""
    from matplotlib.figure import Figure  # the ``bench`` extra

    fig = Figure(figsize=(11, 4.2))
    speed, memory = fig.subplots(1, 2)
    for label in dict.fromkeys(r.label for r in records):
        mine = sorted((r for r in records if r.label == label), key=lambda r: r.seq_len)
        lens = [r.seq_len for r in mine]
        speed.plot(lens, [r.tokens_per_s for r in mine], marker="o", label=label)
        if all(r.peak_activation_bytes for r in mine):
            memory.plot(lens, [r.peak_activation_bytes[0] / 2**20 for r in mine], marker="o", label=label)
    for ax, title in ((speed, "tokens/s (pipeline)"), (memory, "peak activations, rank 0 (MiB)")):
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        ax.set_xticks(sorted({r.seq_len for r in records}))
        ax.grid(alpha=0.3)
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------
# Command line


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description="Benchmark pipeline schedules on real training steps (see the module docstring).",
    )
    ap.add_argument(
        "--schedules",
        default="1F1B,Seq1F1B",
        help="comma-separated NAME[:K[:PARTITION]], e.g. 1F1B,Seq1F1B,Seq1F1B:8:even,TeraPipe",
    )
    ap.add_argument("--seq-lens", type=_ints, default=[2048, 4096], help="comma-separated lengths")
    ap.add_argument("--subsequences", type=int, default=4, help="k of sequence schedules that name none")
    ap.add_argument("--partition", default="compute", choices=PARTITIONS, help="their partition")
    ap.add_argument("--microbatches", type=int, default=4, help="N (local batch size, microbatch size 1)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out (at least 1)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each schedule per length")
    ap.add_argument("--config", default=str(ROOT / "train_configs" / "debug_model.toml"), help="job config")
    ap.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default="off",
        help="torchtitan's per-block torch.compile: off, on, or both (each schedule "
        "eager and compiled, each compared with 1F1B run alike)",
    )
    ap.add_argument(
        "--instrumentation",
        choices=("off", "on", "both"),
        default="on",
        help="the trainer's activation meter and timeline on every step: on, off, or both "
        "(each schedule with and without, alternating: the instrumentation's cost)",
    )
    ap.add_argument("--calibrate", action="store_true", help="measure unit costs, compare the simulator")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per calibration")
    ap.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder")
    ap.add_argument(
        "--dry-run", action="store_true", help="print each run's command and what the job check refuses; run nothing"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error("--warmup must be at least 1 and --steps more than --warmup")
    if args.calibrate and args.compile != "off":
        ap.error("--calibrate times eager units: use it with --compile off")
    try:
        variants = parse_variants(args.schedules, args.subsequences, args.partition, args.compile, args.instrumentation)
    except ValueError as e:
        ap.error(str(e))
    command = "python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    began, load = datetime.now(), os.getloadavg()[0]
    refused = refusals(variants, args)
    for (v, seq_len), message in refused.items():
        print(f"skipped: {v.label} at seq {seq_len}, refused by the job check: {message}", file=sys.stderr)
    if args.dry_run:
        print(dry_run(variants, args, refused))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        records = measure(variants, args, refused)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    header = (
        f"# Benchmark {began:%Y-%m-%d %H:%M}\n\n`{command}`\n\n"
        f"pp={args.pp}, {args.microbatches} microbatches, {args.steps} steps per run "
        f"(first {args.warmup} left out), {args.rounds} rounds; {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end; "
        f"{(datetime.now() - began).total_seconds() / 60:.1f} min. "
        "See `benchmarks/bench.py` for what each figure is."
    )
    records_json = json.dumps([dataclasses.asdict(r) for r in records], indent=1)
    (args.out / "bench.json").write_text(records_json + "\n")
    write_markdown(records, args.out / "bench.md", header)
    try:
        write_plot(records, args.out / "bench.png")
    except ImportError:
        print("bench.png skipped: it needs matplotlib (pip install 'torchtitan_seq[bench]')", file=sys.stderr)
    print((args.out / "bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
