"""Benchmark of pipeline schedules on real training steps.

Usage (from the source checkout: each run is its ``./run_train.sh``)::

    python -m torchtitan_seq.bench --schedules 1F1B,Seq1F1B,Seq1F1B:8:even \\
        --seq-lens 2048,4096 --steps 4 --rounds 2 --out bench_out [--calibrate]

A schedule is ``NAME[:K[:PARTITION]]``: a sequence schedule's k and partition
default to ``--subsequences`` and ``--partition``; torch's schedules (1F1B,
Interleaved1F1B, GPipe, ...) run whole microbatches. Every run trains the
job of ``--config`` (default: the Llama 3 debug model) through
``./run_train.sh`` with overrides, the code path of training itself, on
``--pp`` ranks with ``--microbatches`` microbatches of one sequence. For each
length the schedules alternate run by run (A B C A B C ...) for ``--rounds``
rounds, so that drift in the machine's speed spreads over all of them.

What is measured, per schedule and length, over the steps of all rounds
after the first ``--warmup`` of each run:

* step time: the median wall time between consecutive step lines of
  torchtitan on rank 0 (log timestamps, 1 ms resolution): a whole training
  step, pipeline, optimizer and logging. (torchtitan's own tps is rounded to
  a whole token; the timestamps are finer.)
* tokens/s: the pipeline's tokens per step (microbatches x sequence length)
  over that median. torchtitan's tps is this divided by the ranks.
* peak activation bytes per rank: the largest of the steps, as the trainer
  logs it (bytes autograd keeps for backward, :mod:`torchtitan_seq.memory`).
* bubble ratio per rank and pipeline time: the median over the steps, as
  the trainer logs them (:mod:`torchtitan_seq.timeline`; the pipeline time
  is the makespan of the schedule's compute, without optimizer and logging);
  None for torch's schedules, whose stages are not timed.
* ratios of tokens/s and of rank 0's peak to 1F1B's at the same length.

``--calibrate`` then times the passes of every unit on every pipeline
stage, each stage in its own process (one thread, like a training rank) and
all at once, as the ranks share the machine, at each run's subsequence
lengths (:func:`calibrate`); writes the slowest stage's times as a cost file
of :mod:`torchtitan_seq.simulate` (seconds) in ``--out``; and records the
simulator's predicted step time (makespan of the pipeline alone, no
optimizer, no communication time) and its error against the measured step
and against the measured pipeline time. Calibration and runs are minutes
apart: on a machine shared with other work the comparison is only as good as
the load is steady (``benchmarks/README.md``).

Outputs in ``--out``: ``bench.json`` (a list of records, see :class:`Record`),
``bench.md`` (a table) and ``bench.png`` (tokens/s and rank 0's peak against
the length, one line per schedule; needs matplotlib, the ``bench`` extra),
and under ``runs/`` each run's dump folder with its log, ``train.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

from .partition import PARTITIONS
from .schedules import SEQUENCE_SCHEDULES

__all__ = [
    "Run",
    "parse_log",
    "run_train",
    "Variant",
    "parse_variants",
    "Record",
    "calibrate",
    "predicted_step_time",
    "main",
]

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "1F1B"

# --------------------------------------------------------------------------
# One training run and its log

_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - \S+ - INFO - "
_START = re.compile(_TIME + r"Training starts")
_STEP = re.compile(
    _TIME + r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:.*memory:\s*([\d.]+)GiB.*tps:\s*([\d,]+)"
)
_ACT = re.compile(
    r"step:\s*(\d+)\s+peak activations \(MiB\): (.*?)  bytes: ([\d, ]+?)"
    r"(?:  bubble ratio: (.*)  pipeline: ([\d.]+) ms)?$",
    re.MULTILINE,
)
_LENGTHS = re.compile(r"Sequence pipeline \S+: .* lengths \[([\d, ]+)\]")


def _timestamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _per_rank(text: str) -> list[float]:
    """``"rank0 1.5, rank1 2.5"`` -> [1.5, 2.5]."""
    return [float(item.split()[1]) for item in text.split(",")]


@dataclass
class Run:
    """A training run's exit status, output and per-step figures (rank 0's log)."""

    returncode: int
    output: str
    losses: list[float] = field(default_factory=list)
    memory_gib: list[float] = field(default_factory=list)
    tps: list[int] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    """Wall time of each step: since the previous step line (step 1: since training started)."""
    activations_mib: list[list[float]] = field(default_factory=list)  # per step, per rank
    activation_bytes: list[list[int]] = field(default_factory=list)  # per step, per rank
    bubble_ratios: list[list[float]] = field(default_factory=list)  # per step, per rank; [] untimed
    pipeline_s: list[float | None] = field(default_factory=list)
    """Per step, the pipeline's makespan (None: stages not timed)."""
    lengths: list[int] | None = None
    """The subsequence lengths a sequence schedule logged at start-up."""


def parse_log(returncode: int, output: str) -> Run:
    """The figures of a training log (torchtitan's step lines and ours)."""
    run = Run(returncode, output)
    start = _START.search(output)
    last = _timestamp(start.group(1)) if start else None
    for m in _STEP.finditer(output):
        now = _timestamp(m.group(1))
        if last is not None:
            run.step_times_s.append(now - last)
        last = now
        run.losses.append(float(m.group(3)))
        run.memory_gib.append(float(m.group(4)))
        run.tps.append(int(m.group(5).replace(",", "")))
    for m in _ACT.finditer(output):
        run.activations_mib.append(_per_rank(m.group(2)))
        run.activation_bytes.append([int(b) for b in m.group(3).split(",")])
        run.bubble_ratios.append(_per_rank(m.group(4)) if m.group(4) else [])
        run.pipeline_s.append(float(m.group(5)) / 1e3 if m.group(5) else None)
    lengths = _LENGTHS.search(output)
    if lengths:
        run.lengths = [int(x) for x in lengths.group(1).split(",")]
    return run


def run_train(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """``./run_train.sh`` with torchtitan overrides; the job writes under ``dump_folder``."""
    script = ROOT / "run_train.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the benchmark runs from the source checkout")
    proc = subprocess.run(
        [str(script), "--job.dump_folder", str(dump_folder), *overrides],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return parse_log(proc.returncode, proc.stdout + proc.stderr)


# --------------------------------------------------------------------------
# What runs


@dataclass(frozen=True)
class Variant:
    """A schedule with its sequence cut (k = 1 and no partition for torch's schedules)."""

    schedule: str
    num_subsequences: int = 1
    partition: str | None = None

    @property
    def is_sequence(self) -> bool:
        return self.schedule in SEQUENCE_SCHEDULES

    @property
    def label(self) -> str:
        if not self.is_sequence:
            return self.schedule
        return f"{self.schedule} k={self.num_subsequences} {self.partition}"

    def overrides(self) -> list[str]:
        out = ["--parallelism.pipeline_parallel_schedule", self.schedule]
        if self.is_sequence:
            out += [
                "--sequence_pipeline.num_subsequences", str(self.num_subsequences),
                "--sequence_pipeline.partition", str(self.partition),
            ]
        return out


def parse_variants(spec: str, subsequences: int, partition: str) -> list[Variant]:
    """``"1F1B,Seq1F1B,Seq1F1B:8:even"`` -> variants; k and partition default to the given ones."""
    variants = []
    for item in spec.split(","):
        name, *rest = item.strip().split(":")
        if name not in SEQUENCE_SCHEDULES:
            if rest:
                raise ValueError(f"{item!r}: {name} is torch's schedule, it takes no k or partition")
            variants.append(Variant(name))
            continue
        if len(rest) > 2:
            raise ValueError(f"{item!r}: use NAME[:K[:PARTITION]]")
        k = int(rest[0]) if rest else subsequences
        part = rest[1] if len(rest) > 1 else partition
        if part not in PARTITIONS:
            raise ValueError(f"{item!r}: partition {part!r} is not one of {PARTITIONS}")
        variants.append(Variant(name, k, part))
    return variants


@dataclass
class Record:
    """One schedule at one length: what ``bench.json`` holds."""

    schedule: str
    label: str
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
    peak_activation_bytes: list[int]
    """Per rank, the largest of the measured steps."""
    bubble_ratio: list[float] | None
    """Per rank, median of the measured steps; None when the stages are not timed."""
    pipeline_time_s: float | None
    """Median makespan of the pipeline's compute; None when the stages are not timed."""
    tokens_per_s_ratio: float | None = None
    """tokens/s over 1F1B's at the same length (None without a 1F1B run)."""
    peak_activation_ratio: float | None = None
    """Rank 0's peak over 1F1B's at the same length."""
    cost_file: str | None = None
    predicted_step_time_s: float | None = None
    """The simulator's makespan under ``cost_file`` (``--calibrate``)."""
    prediction_error: float | None = None
    """predicted / measured step time - 1."""
    pipeline_prediction_error: float | None = None
    """predicted / measured pipeline time - 1."""


def _job_overrides(variant: Variant, seq_len: int, args: argparse.Namespace) -> list[str]:
    return [
        *variant.overrides(),
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(args.microbatches),
        "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--parallelism.pipeline_parallel_degree", str(args.pp),
        "--training.steps", str(args.steps),
        "--metrics.log_freq", "1",
    ]


def _check_run(run: Run, steps: int, what: str) -> None:
    """Fail unless every step was logged. A run that fails after its last step (seen once: a
    rank aborting with SIGABRT at shutdown) still measured every step: it is kept, with a warning."""
    if len(run.step_times_s) != steps or len(run.activation_bytes) != steps:
        raise RuntimeError(f"{what} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    if run.returncode != 0:
        print(f"warning: {what} exited with {run.returncode} after its last step", file=sys.stderr)


def measure(variants: list[Variant], args: argparse.Namespace) -> list[Record]:
    """Run every variant ``args.rounds`` times at each length, alternating; one record each."""
    env = {"NGPU": str(args.pp), "CONFIG_FILE": str(Path(args.config).resolve())}
    total = len(args.seq_lens) * args.rounds * len(variants)
    records = []
    count = 0
    for seq_len in args.seq_lens:
        runs: dict[Variant, list[Run]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants:
                count += 1
                what = f"[{count}/{total}] seq {seq_len} round {r + 1}/{args.rounds} {v.label}"
                began = time.monotonic()
                folder = args.out / "runs" / f"{v.label.replace(' ', '_').replace('=', '')}_s{seq_len}_r{r}"
                run = run_train(*_job_overrides(v, seq_len, args), dump_folder=folder, env=env)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "train.log").write_text(run.output)
                _check_run(run, args.steps, what)
                runs[v].append(run)
                kept = run.step_times_s[args.warmup:]
                print(
                    f"{what}: median step {statistics.median(kept):.3f} s, peak rank 0 "
                    f"{max(b[0] for b in run.activation_bytes) / 2**20:.1f} MiB "
                    f"({time.monotonic() - began:.0f} s)",
                    flush=True,
                )
        records += [_record(v, seq_len, runs[v], args) for v in variants]
    _add_ratios(records)
    return records


def _record(variant: Variant, seq_len: int, runs: list[Run], args: argparse.Namespace) -> Record:
    keep = slice(args.warmup, None)
    times = [t for run in runs for t in run.step_times_s[keep]]
    peaks = [b for run in runs for b in run.activation_bytes[keep]]
    bubbles = [b for run in runs for b in run.bubble_ratios[keep] if b]
    pipeline = [t for run in runs for t in run.pipeline_s[keep] if t is not None]
    median = statistics.median(times)
    return Record(
        schedule=variant.schedule,
        label=variant.label,
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
        peak_activation_bytes=[max(step[r] for step in peaks) for r in range(len(peaks[0]))],
        bubble_ratio=[statistics.median(step[r] for step in bubbles) for r in range(len(bubbles[0]))]
        if bubbles
        else None,
        pipeline_time_s=statistics.median(pipeline) if pipeline else None,
    )


def _add_ratios(records: list[Record]) -> None:
    base = {r.seq_len: r for r in records if r.schedule == BASELINE}
    for r in records:
        b = base.get(r.seq_len)
        if b is not None:
            r.tokens_per_s_ratio = r.tokens_per_s / b.tokens_per_s
            r.peak_activation_ratio = r.peak_activation_bytes[0] / b.peak_activation_bytes[0]


# --------------------------------------------------------------------------
# Calibration: measured unit times for the simulator


def _stage_model(flavor: str, seq_len: int, pp: int, stage: int) -> tuple[torch.nn.Module, object]:
    """Stage ``stage`` of ``pp`` of the flavor's SeqTransformer, cut as torchtitan's pipeline split
    cuts it (its default first- and last-stage weights), and the model args."""
    from torchtitan.config import Parallelism
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    from .model import SeqTransformer, seq_llama3_flavors

    args = dataclasses.replace(seq_llama3_flavors[flavor], max_seq_len=seq_len)
    defaults = Parallelism()
    keep = set(
        generate_llm_fqn_per_model_part(
            pp,
            args.n_layers,
            defaults.pipeline_parallel_first_stage_less_layers,
            defaults.pipeline_parallel_last_stage_less_layers,
        )[stage]
    )
    model = SeqTransformer(args)
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.ModuleDict):
            for layer in list(child):
                if f"{name}.{layer}" not in keep:
                    del child[layer]
        elif name not in keep:
            setattr(model, name, None)
    return model, args


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def _calibrate_stage(
    seq_len: int,
    lengths: list[int],
    pp: int,
    stage: int,
    units: bool,
    flavor: str,
    repeats: int,
    device: str,
    barrier,
) -> dict[str, list[float]]:
    """Median seconds of each pass of each unit on one stage (one process; see :func:`calibrate`)."""
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )

    from .attention import select_kernel
    from .kv_context import KVContext, Unit
    from .model import bind_kv_context

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as a training rank on a CPU (run_train.sh's OMP_NUM_THREADS=1)
    torch.manual_seed(stage)
    model, model_args = _stage_model(flavor, seq_len, pp, stage)
    model.to(dev)
    first, last = stage == 0, stage == pp - 1
    context = KVContext()
    if units:
        bind_kv_context(model, context, select_kernel(dev))
    k = len(lengths)
    offsets = [sum(lengths[:j]) for j in range(k)]
    dim, vocab = model_args.dim, model_args.vocab_size

    def unit(j: int) -> Unit:
        return Unit(0, j, offsets[j], lengths[j], k)

    def forward(j: int, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with context.running(unit(j)) if units else contextlib.nullcontext():
            out = model(x)
        if not last:
            return out
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")
        return loss / seq_len

    def one_round() -> dict[str, list[float]]:
        if first:
            inputs = [torch.randint(vocab, (1, n), device=dev) for n in lengths]
        else:
            inputs = [torch.randn(1, n, dim, device=dev, requires_grad=True) for n in lengths]
        targets = [torch.randint(vocab, (1, n), device=dev) for n in lengths]
        times: dict[str, list[float]] = {p: [0.0] * k for p in "FBIW"}
        for split in (False, True):
            outs = []
            for j in range(k):
                times["F"][j], out = _timed(lambda: forward(j, inputs[j], targets[j]), dev)
                outs.append(out)
            grads = [None if last else torch.randn_like(o) for o in outs]
            values = [[] if first else [x] for x in inputs]
            for j in reversed(range(k)):
                if not split or first:
                    # The first stage has no input gradient: torch runs its I as nothing
                    # and its W as a full backward.
                    with context.backward(unit(j)):
                        t, _ = _timed(lambda: stage_backward(outs[j], grads[j], values[j]), dev)
                    times["W" if split else "B"][j] = t
                    continue
                out = (outs[j],)
                grad = None if last else (grads[j],)
                with context.backward(unit(j), last_pass=False):
                    times["I"][j], (_, groups) = _timed(
                        lambda: stage_backward_input(out, grad, values[j], model.parameters()), dev
                    )
                with context.backward(unit(j)):
                    times["W"][j], _ = _timed(
                        lambda: stage_backward_weight(model.parameters(), groups), dev
                    )
            context.clear()
            model.zero_grad(set_to_none=True)
        return times

    barrier.wait()
    one_round()  # allocations, kernel choice
    rounds = []
    for _ in range(repeats):
        barrier.wait()  # every stage times its passes while the others run theirs
        rounds.append(one_round())
    return {p: [statistics.median(r[p][j] for r in rounds) for j in range(k)] for p in "FBIW"}


def calibrate(
    seq_len: int,
    lengths: list[int],
    pp: int,
    *,
    units: bool,
    flavor: str = "debugmodel",
    repeats: int = 3,
    device: str = "cpu",
) -> dict:
    """Seconds of each pass of each unit on the slowest stage: the simulator's cost file.

    Each of the ``pp`` stages runs in its own process, all at once, as the
    training ranks share the machine (on a CPU they contend for cores and
    memory bandwidth), each rank's stage cut as torchtitan cuts the model.
    ``units``: run subsequences ``lengths`` through a KV context, as a
    sequence schedule does; otherwise the whole sequence with plain attention,
    as torch's schedules do (``lengths`` is then ``[seq_len]``). Per round,
    the units run forward in order and a full backward (B) last unit first,
    then forward again and the split backward: input gradients (I), then
    weight gradients (W), with torch's own ``stage_backward*`` functions, as
    the pipeline stage runs them. The last stage's loss (sum cross-entropy over
    the sequence) counts as forward. Median of ``repeats`` rounds after one
    untimed round. The simulator gives every stage the same costs: F, B, I
    and W are those of the slowest stage (largest total F + B), ``stage``;
    ``stages`` keeps every stage's.
    """
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(pp) as pool:
        barrier = manager.Barrier(pp)
        work = [(seq_len, lengths, pp, s, units, flavor, repeats, device, barrier) for s in range(pp)]
        stages = pool.starmap(_calibrate_stage, work)
    slowest = max(range(pp), key=lambda s: sum(stages[s]["F"]) + sum(stages[s]["B"]))
    return {
        **stages[slowest],
        "stage": slowest,
        "stages": stages,
        "unit": "s",
        "seq_len": seq_len,
        "lengths": lengths,
        "flavor": flavor,
        "repeats": repeats,
        "device": device,
    }


def predicted_step_time(record: Record, cost_file: Path) -> float:
    """The simulator's makespan of ``record``'s schedule under the measured costs, in seconds."""
    from .simulate import SimConfig, simulate

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


def add_predictions(records: list[Record], out: Path, repeats: int) -> None:
    """Calibrate each (length, cut) once and record the simulator's prediction for every record."""
    files: dict[tuple[int, tuple[int, ...], bool], Path] = {}
    for r in records:
        units = r.schedule in SEQUENCE_SCHEDULES
        key = (r.seq_len, tuple(r.lengths), units)
        if key not in files:
            began = time.monotonic()
            cost = calibrate(r.seq_len, r.lengths, r.pp, units=units, repeats=repeats)
            cut = "-".join(map(str, r.lengths))
            files[key] = out / f"cost_s{r.seq_len}_{'units' if units else 'whole'}_{cut}.json"
            files[key].write_text(json.dumps(cost, indent=1) + "\n")
            print(f"calibrated {files[key].name} ({time.monotonic() - began:.0f} s)", flush=True)
        r.cost_file = files[key].name
        r.predicted_step_time_s = predicted_step_time(r, files[key])
        r.prediction_error = r.predicted_step_time_s / r.step_time_s - 1
        if r.pipeline_time_s is not None:
            r.pipeline_prediction_error = r.predicted_step_time_s / r.pipeline_time_s - 1


# --------------------------------------------------------------------------
# Reports


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def write_markdown(records: list[Record], path: Path, header: str) -> None:
    rows = [
        "| schedule | seq | lengths | step time (s) | tokens/s | x 1F1B | peak act. rank 0 (MiB) | x 1F1B "
        "| peak act. per rank (MiB) | bubble ratio per rank | pipeline (s) | predicted (s) "
        "| error vs step | vs pipeline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        peaks = ", ".join(f"{b / 2**20:.1f}" for b in r.peak_activation_bytes)
        bubbles = ", ".join(f"{b:.3f}" for b in r.bubble_ratio) if r.bubble_ratio else ""
        rows.append(
            f"| {r.label} | {r.seq_len} | {r.lengths} | {r.step_time_s:.3f} | {r.tokens_per_s:.0f} "
            f"| {_fmt(r.tokens_per_s_ratio, '.3f')} | {r.peak_activation_bytes[0] / 2**20:.1f} "
            f"| {_fmt(r.peak_activation_ratio, '.3f')} | {peaks} | {bubbles} "
            f"| {_fmt(r.pipeline_time_s, '.3f')} | {_fmt(r.predicted_step_time_s, '.3f')} "
            f"| {_fmt(r.prediction_error, '+.1%')} | {_fmt(r.pipeline_prediction_error, '+.1%')} |"
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
        prog="python -m torchtitan_seq.bench",
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
    ap.add_argument("--calibrate", action="store_true", help="measure unit costs, compare the simulator")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per calibration")
    ap.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error("--warmup must be at least 1 and --steps more than --warmup")
    try:
        variants = parse_variants(args.schedules, args.subsequences, args.partition)
    except ValueError as e:
        ap.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m torchtitan_seq.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    began, load = datetime.now(), os.getloadavg()[0]
    try:
        records = measure(variants, args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.calibrate:
        add_predictions(records, args.out, args.repeats)
    header = (
        f"# Benchmark {began:%Y-%m-%d %H:%M}\n\n`{command}`\n\n"
        f"pp={args.pp}, {args.microbatches} microbatches, {args.steps} steps per run "
        f"(first {args.warmup} left out), {args.rounds} rounds; {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end; "
        f"{(datetime.now() - began).total_seconds() / 60:.1f} min. "
        "See `torchtitan_seq/bench.py` for what each figure is."
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
