"""Choosing a configuration: the best schedule and settings for a model, a cluster and a memory budget.

    python -m torchtitan_seq.plan --flavor 8B --seq-len 32768 --gpus 64 --gpu-memory-gib 80 \\
        --local-batch-size 16 [--tp 8] [--gpus-per-node 8] [--cost FILE] [--processes 4] [--json]

The search covers the pipeline, tensor-, context- and data-parallel (FSDP) degrees, the
schedule (torch's and the sequence schedules), k, the partition and the
activation checkpointing mode (:data:`CHOICES` on every split of the GPUs); the
stages per rank are each schedule's own, not searched. Every configuration is cut
as the runtime cuts it (:class:`~torchtitan_seq.shape.JobShape`, ``--length-multiple``),
and a plan carries its lengths and sets ``length_multiple``. Memory is the memory model's
(:mod:`torchtitan_seq.simulate.memory`, the fullest rank's total); time is the
simulator's (:mod:`torchtitan_seq.simulate`) with the network's transfers and
the recomputation of the AC mode, plus TP's collectives, which torchtitan does
not overlap (data-parallel collectives are taken as overlapped). It does not
simulate every combination at full size:

- candidates are visited best bound first and the search stops once the next bound
  cannot enter the table. A bound is the tokens/s of a step no shorter than the
  busiest rank's work (its units, their fixed cost and CP's K/V collectives) with the
  fill and drain before its first and after its last pass (p - 1 stages on one chain,
  (p - 1) // 2 where two chains start on both ends), nor than one microbatch's chain of
  passes (few microbatches on many stages); no transfers, no other bubbles (tested
  against the simulation);
- memory is only asked of what is visited, and first of the memory model's floor
  (:func:`~torchtitan_seq.simulate.memory.memory_floor`: each rank's states, workspace,
  buffers and one microbatch in flight on its stages of a chain, from the schedule's
  placement; then, with the lists, what the rank holds where it holds the most units):
  most candidates exceed it by far and are dropped without an estimate;
- a configuration is slower than the same one with less TP, less CP or less
  recomputation (its bound is lower, so it mostly comes later): once one fits, the
  heavier ones of its schedule choice and p are skipped (or dropped, where a near tie of
  bounds met one first), and when the heaviest-saving one of a CP degree (most TP, full
  AC) does not fit, none of that CP degree is kept (it is estimated once a candidate of
  it fits). CP (:mod:`torchtitan_seq.context_parallel`) splits each unit's
  compute over c GPUs of the same replica and adds K/V collectives, while data
  parallelism over them would run other sequences: a CP plan only enters the table
  where its twin without CP does not fit (long sequences, tight memory);
- a step is simulated at N' = min(N, 2p) and 2N' microbatches and extended
  linearly to N (at N alone where N <= 4p): past the warm-up each further
  microbatch adds the same time (within 1%, tested), on the compute-only lists (``torch_lowering=False``:
  the same timeline, without torch's lowering passes); lists, their
  preparation for timing and the memory model's walks are built once per
  shape and reused across TP, AC and cost choices;
- with more than one CPU, the search runs in up to 4 processes (``--processes``): forked helpers
  visit the candidates of their share of schedule shapes ahead of the search, which takes their
  answers (:mod:`torchtitan_seq.lookahead`): the same plans, in less time.

Unit times are the transformer cost model (:class:`~torchtitan_seq.partition.UnitCost`)
at ``--tflops`` achieved per GPU, plus a fixed cost per unit and layer
(``--unit-overhead-ms``, by default :data:`H200_UNIT_OVERHEAD_S`, measured): what
a unit costs beyond its share of the FLOPs, which makes many short units slower
than few long ones. With ``--cost``, calibration files
(``benchmarks/bench.py --calibrate``) replace both: a configuration whose pp and
sequence cut were measured uses those unit times, the others the model at the
FLOP/s the files achieved plus the fixed cost fitted to them
(:func:`~torchtitan_seq.simulate.costs.fit_cost_files`). ``benchmarks/planner_check.py`` sets the planner's
ranking and peaks beside a measured benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import get_args

if __name__ == "__main__":
    # Run as the command, the cyclic collector is off from here to the exit. Importing torch and
    # torch.distributed.pipelining (below) makes hundreds of thousands of objects, and the collections
    # they set off walk them again and again: 0.8 s of a 3.5 s import here. The search makes millions of small
    # acyclic objects (see _without_cycle_collection), and a collector turned back on would walk what it
    # cached once more just before the process ends. Imported as a module, nothing changes.
    gc.disable()

from .flavors import flavor_shape, flavor_shapes
from .lookahead import SKIP, Lookahead, available_processes
from .partition import Partition, UnitCost
from .render import busy_and_end
from .schedules import SEQUENCE_SCHEDULES, ScheduleShape
from .shape import LENGTH_MULTIPLE, JobShape
from .simulate.build import SimConfig, build
from .simulate.costs import fit_cost_files, seconds_per_time_unit, subsequence_lengths
from .simulate.engine import simulate
from .simulate.memory import ACMode, Device, MemoryConfig, MemoryEstimate, gib, memory_floor, predict_memory
from .simulate.network import Link, Network

__all__ = [
    "ScheduleChoice",
    "Plan",
    "Job",
    "Cluster",
    "CHOICES",
    "AC_MODES",
    "H200_UNIT_OVERHEAD_S",
    "plan",
    "evaluate",
    "memory",
    "main",
]

AC_MODES: tuple[ACMode, ...] = get_args(ACMode)
# Forward passes recomputed per backward: torchtitan's 'selective' default checkpoints every 2nd layer.
_RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0}
TP_DEGREES = (1, 2, 4, 8)
CP_DEGREES = (1, 2, 4, 8)

H200_UNIT_OVERHEAD_S = 2.11e-3
"""Seconds a unit's forward + backward costs per layer beyond its share of the FLOPs, measured on
an H200 (``benchmarks/gpu/2026-11-30/cudnn``: torch 2.11, cuDNN 9.19, a 4-layer Llama 3 stack of
dim 2048, 16 heads, 8 KV heads, bf16, batch 1, units through the KV context). Derivation:
:func:`~torchtitan_seq.simulate.costs.fit_cost_files` over its cost files at 16K, 32K and 64K
tokens (the whole sequence and every cut, k = 1, 2, 4, 8: 48 units) fits fixed = 8.45 ms per
unit, per-token 2.0 us and per-pair 0.24 ns, for the 4 layers: 2.11 ms per layer. The 8K files
are left out: there the fit's per-token cost turns negative (units of 1-2K tokens are not
linear in their tokens on this GPU). Fitted at one length each: 9.3 ms (16K), 6.3 ms (32K), 9.1 ms
(64K); at 32K the fixed cost is 19.5% of the F + B of a cut into 8 units (measured overhead
against the whole sequence: +29%) and 10.8% at k = 4. Taken as the GPU's and the code's, whatever
the model's width: kernel launches, host work and the per-call merges of unit attention do not
shrink with a unit, and are not divided by TP."""


@dataclass(frozen=True)
class ScheduleChoice:
    """A schedule with its own settings, independent of the GPUs it runs on."""

    schedule: str
    num_subsequences: int = 1
    partition: Partition = "even"
    stages_per_rank: int = 1

    @property
    def parameter_copies(self) -> int:
        """Copies of each model chunk (2 for the two-chain schedules)."""
        return getattr(SEQUENCE_SCHEDULES.get(self.schedule), "parameter_copies", 1)


def _choices() -> list[ScheduleChoice]:
    torch_choices = [
        ScheduleChoice("1F1B"),
        ScheduleChoice("GPipe"),
        ScheduleChoice("Interleaved1F1B", stages_per_rank=2),
    ]
    seq = [ScheduleChoice("Seq1F1B", k, part) for k in (2, 4, 8, 16) for part in ("even", "compute")]
    seq += [ScheduleChoice("InterleavedSeq1F1B", k, part, 2) for k in (2, 4, 8) for part in ("even", "compute")]
    seq += [ScheduleChoice("TeraPipe", k, "latency") for k in (2, 4, 8)]
    for name in ("BSIPipe", "Chimera"):
        if name in SEQUENCE_SCHEDULES:
            v = SEQUENCE_SCHEDULES[name].stages_per_rank
            seq += [ScheduleChoice(name, 1, "even", v)] + [ScheduleChoice(name, k, "compute", v) for k in (2, 4)]
    return torch_choices + seq


CHOICES: list[ScheduleChoice] = _choices()
"""What the search tries on every pipeline degree."""


@dataclass(frozen=True)
class Plan:
    """One configuration and what the models predict for it."""

    schedule: str
    pp: int
    tp: int
    dp_shard: int
    num_subsequences: int
    partition: Partition
    stages_per_rank: int
    activation_checkpoint: ACMode
    tokens_per_s: float
    """Whole job (every data-parallel replica)."""
    peak_memory_gib: float
    """The largest over pipeline ranks."""
    bubble_ratio: float
    """Idle share of the busiest rank's step."""
    fits: bool
    lengths: tuple[int, ...] = ()
    """The subsequence lengths evaluated, which the runtime cuts with :meth:`overrides`."""
    length_multiple: int = LENGTH_MULTIPLE
    """``sequence_pipeline.length_multiple`` of the job (the lengths are multiples of it and of tp)."""
    cp: int = 1
    """``context_parallel_degree`` (sequence schedules only)."""

    def overrides(self, flavor: str, seq_len: int, local_batch_size: int) -> str:
        """The configuration as ``./run_train.sh`` arguments."""
        args = {
            "model.flavor": flavor,
            "training.seq_len": seq_len,
            "training.local_batch_size": local_batch_size,
            "parallelism.pipeline_parallel_degree": self.pp,
            "parallelism.tensor_parallel_degree": self.tp,
            "parallelism.data_parallel_shard_degree": self.dp_shard,
            **({"parallelism.context_parallel_degree": self.cp} if self.cp > 1 else {}),
            "parallelism.pipeline_parallel_microbatch_size": 1,
            "parallelism.pipeline_parallel_schedule": self.schedule,
            "activation_checkpoint.mode": self.activation_checkpoint,
        }
        if self.schedule in SEQUENCE_SCHEDULES:
            args["sequence_pipeline.num_subsequences"] = self.num_subsequences
            args["sequence_pipeline.partition"] = self.partition
            args["sequence_pipeline.length_multiple"] = self.length_multiple
        return " ".join(f"--{k} {v}" for k, v in args.items())

    def toml(self, flavor: str, seq_len: int, local_batch_size: int) -> str:
        """The configuration as a torchtitan TOML snippet."""
        sections: dict[str, dict[str, object]] = {}
        for arg in self.overrides(flavor, seq_len, local_batch_size).split(" --"):
            key, value = arg.removeprefix("--").split(" ")
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = value if not value.isdigit() else int(value)
        return "\n\n".join(
            f"[{section}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
            for section, fields in sections.items()
        )


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job may use."""

    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    flops_per_gpu: float = 400e12
    """Achieved FLOP/s per GPU (about 40% of an H100's dense bf16 peak)."""
    intra_node: Link = Link(200e9, 5e-6)
    """NVLink-class, per GPU and direction."""
    inter_node: Link = Link(25e9, 1e-5)
    """One 200 Gb/s NIC per GPU."""
    device: Device = "cuda"
    """What the memory model sizes (RMSNorm saves more on the CPU)."""
    unit_overhead_s: float = H200_UNIT_OVERHEAD_S
    """Fixed seconds per unit (forward + backward) and layer on top of the cost model's FLOPs."""


@dataclass(frozen=True)
class Job:
    """What is trained: a flavor at a sequence length, ``local_batch_size`` sequences per
    data-parallel rank and step, one sequence per microbatch."""

    flavor: str
    seq_len: int
    local_batch_size: int
    tp: int | None = None
    """A fixed TP degree; None searches 1, 2, 4, 8 within a node."""
    costs: tuple[Path, ...] = ()
    """Calibration files (``bench.py --calibrate``) of this flavor and sequence length."""
    length_multiple: int = LENGTH_MULTIPLE
    """``sequence_pipeline.length_multiple``: every subsequence length a multiple of it and of tp."""
    cp: int | None = None
    """A fixed CP degree (sequence schedules); None searches 1, 2, 4, 8."""

    def shape(self, choice: ScheduleChoice, tp: int, cp: int = 1) -> JobShape:
        """The cut and microbatches of ``choice`` at TP ``tp`` and CP ``cp``, as the runtime derives them."""
        return JobShape.of_model(
            flavor_shape(self.flavor),
            self.seq_len,
            choice.num_subsequences,
            choice.partition,
            length_multiple=self.length_multiple,
            tp=tp,
            microbatches=self.local_batch_size,
            stages_per_rank=choice.stages_per_rank,
            whole=choice.schedule not in SEQUENCE_SCHEDULES,
            cp=cp,
        )


@dataclass(frozen=True)
class _Candidate:
    choice: ScheduleChoice
    pp: int
    tp: int
    dp: int
    ac: ACMode
    bound: float
    cp: int = 1
    """tokens/s without bubbles or transfers under the cost model: what the simulation
    can at best reach (with measured costs, about)."""


def _meshes(job: Job, cluster: Cluster, args) -> list[tuple[int, int, int, int]]:
    """(pp, tp, cp, dp_shard) splits of the GPUs: TP within a node and dividing the heads, pp >= 2."""
    heads = (args.n_heads, args.n_kv_heads or args.n_heads)
    if job.tp is not None:
        if cluster.gpus % job.tp:
            raise ValueError(f"--gpus {cluster.gpus} is not a multiple of --tp {job.tp}")
        if any(h % job.tp for h in heads) or job.tp > cluster.gpus_per_node:
            raise ValueError(
                f"--tp {job.tp}: TP must divide the {job.flavor} heads {heads} and fit a node of "
                f"{cluster.gpus_per_node} GPUs"
            )
    tps = (
        [job.tp] if job.tp else [t for t in TP_DEGREES if t <= cluster.gpus_per_node and not any(h % t for h in heads)]
    )
    if job.cp is not None and (job.cp < 1 or cluster.gpus % job.cp):
        raise ValueError(f"--cp {job.cp}: it must be at least 1 and divide --gpus {cluster.gpus}")
    cps = [job.cp] if job.cp else list(CP_DEGREES)
    meshes = [
        (pp, tp, cp, cluster.gpus // (pp * tp * cp))
        for tp in tps
        for pp in range(2, min(args.n_layers, cluster.gpus // tp) + 1)
        for cp in cps
        if cluster.gpus % (pp * tp * cp) == 0
    ]
    if not meshes:
        raise ValueError(
            f"--gpus {cluster.gpus}: no pipeline degree of at least 2 divides it with TP {tps} "
            f"(and at most the {args.n_layers} layers of {job.flavor}): use a multiple of 2 x TP"
        )
    return meshes


def _unit_flops(cost: UnitCost, lengths: list[int], recompute: float) -> list[tuple[float, float]]:
    """Per unit, cost-model FLOPs of its forward and of its backward (``recompute`` forwards
    included) on one layer."""
    prefixes = [sum(lengths[:j]) for j in range(len(lengths))]
    return [
        (cost.forward(n, p), recompute * cost.forward(n, p) + cost.backward_input(n, p) + cost.backward_weight(n, p))
        for n, p in zip(lengths, prefixes)
    ]


def _step_flops(units: list[tuple[float, float]], n_layers: int, pp: int) -> float:
    """Cost-model FLOPs of one microbatch's passes (``units``: :func:`_unit_flops`) on 1/pp of the layers."""
    return n_layers / pp * sum(f + b for f, b in units)


def _stage_layers(choice: ScheduleChoice, n_layers: int, pp: int) -> float:
    """Layers of one of ``choice``'s stages on pp ranks: a chain holds the model over p v / copies stages."""
    return n_layers * choice.parameter_copies / (pp * choice.stages_per_rank)


def _fill_flops(choice: ScheduleChoice, units: list[tuple[float, float]], n_layers: int, pp: int) -> float:
    """FLOPs the busiest-placed rank cannot overlap (``units``: :func:`_unit_flops`): its first forward
    waits for a unit's forward to cross the stages before its first position in a chain, and after its
    last backward that unit's backward crosses them again (stages of n_layers / chain length layers).
    One chain: rank p-1, p-1 stages. Two chains start on both ends: a rank at position q holds
    positions q and p-1-q of the chains (in a V also 2p-1-q and p+q), so the middle ranks wait
    (p-1) // 2 stages."""
    hops = (pp - 1) // choice.parameter_copies
    return hops * _stage_layers(choice, n_layers, pp) * (min(f for f, _ in units) + min(b for _, b in units))


def _path_flops(choice: ScheduleChoice, units: list[tuple[float, float]], n_layers: int, pp: int) -> float:
    """FLOPs of one microbatch's longest chain of passes, which no schedule runs in parallel: unit 0's
    forward through the chain's every stage, units 1..k-1's forwards on the last (each reads the K/V
    of the one before), unit k-1's backward back through every stage, and units k-2..0's backwards on
    the first (each takes its dK/dV from the ones after). What bounds a step with few microbatches
    on many stages."""
    (f0, _), (_, b_last) = units[0], units[-1]
    return n_layers * (f0 + b_last) + _stage_layers(choice, n_layers, pp) * (
        sum(f for f, _ in units[1:]) + sum(b for _, b in units[:-1])
    )


@dataclass(frozen=True)
class _Costs:
    """Where unit times come from: a calibration file measured at the same pp, chunks per
    rank, chunk count and cut, else the transformer model at ``flops_per_gpu`` plus
    ``unit_overhead_s`` per unit and layer, which the files (when given) fit: the fixed cost
    of :func:`~torchtitan_seq.simulate.costs.fit_cost_files` (none when their units cannot
    separate it) and the geometric mean of the cost-model FLOP/s the rest achieved."""

    files: tuple[tuple[tuple[int, int, int, tuple[int, ...]], str], ...]
    flops_per_gpu: float
    unit_overhead_s: float = 0.0

    @classmethod
    def load(cls, job: Job, cluster: Cluster, args) -> _Costs:
        if not job.costs:
            return cls((), cluster.flops_per_gpu, cluster.unit_overhead_s)
        files, rates, loaded = {}, [], []
        for path in job.costs:
            data = json.loads(path.read_text()) if path.is_file() else {}
            if data.get("unit") != "s" or "lengths" not in data or "stages" not in data:
                raise ValueError(f"--cost {path}: not a calibration file (benchmarks/bench.py --calibrate writes them)")
            if data.get("flavor") != job.flavor or data.get("seq_len") != job.seq_len:
                raise ValueError(
                    f"--cost {path}: measured for flavor {data.get('flavor')!r} at seq_len {data.get('seq_len')}, "
                    f"not {job.flavor!r} at {job.seq_len}"
                )
            pp, lengths = len(data["stages"]), tuple(data["lengths"])
            chunks = data.get("chunks", [[r] for r in range(pp)])
            files[pp, len(chunks[0]), 1 + max(map(max, chunks)), lengths] = str(path)
            loaded.append((path, pp, data))
        # Their fixed cost per unit, per layer: a fit needs one stage size (else none is taken).
        pps = {pp for _, pp, _ in loaded}
        fixed_per_layer = 0.0
        if len(pps) == 1:
            try:
                fixed_per_layer = fit_cost_files([path for path, _, _ in loaded]).fixed * pps.pop() / args.n_layers
            except ValueError:
                pass  # units of one length only: the FLOP rate below absorbs the fixed cost
        for _, pp, data in loaded:
            lengths = list(data["lengths"])
            measured = sum(data["F"]) + sum(data["B"]) - len(lengths) * fixed_per_layer * args.n_layers / pp
            rates.append(
                _step_flops(_unit_flops(UnitCost.from_model_args(args), lengths, 0.0), args.n_layers, pp) / measured
            )
        return cls(tuple(files.items()), math.exp(sum(map(math.log, rates)) / len(rates)), fixed_per_layer)

    def cost_for(self, choice: ScheduleChoice, pp: int, lengths: list[int]) -> str:
        """SimConfig.cost for ``choice`` on ``pp`` ranks cutting sequences into ``lengths``."""
        chunks = pp * choice.stages_per_rank // choice.parameter_copies
        return dict(self.files).get((pp, choice.stages_per_rank, chunks, tuple(lengths)), "transformer")


def _tp_seconds(args, seq_len: float, pp: int, tp: int, recompute: float, cluster: Cluster) -> float:
    """Tensor parallelism's collectives for one microbatch on one rank, which torchtitan does
    not overlap with compute: per layer, sequence parallelism's two all-gathers and two
    reduce-scatters of the activations (bf16) in forward, as many in backward and in each
    recomputed forward, each moving (tp - 1) / tp of S x dim (under CP the rank's S / c) over a
    ring in the node."""
    if tp == 1:
        return 0.0
    per_collective = cluster.intra_node.seconds((tp - 1) / tp * seq_len * args.dim * 2)
    return args.n_layers / pp * 4 * (2 + recompute) * per_collective


def _network(cluster: Cluster, costs: _Costs, tp: int, cp: int, dp: int) -> Network:
    """The links of a (tp, cp, dp) rank of ``cluster``, at the costs' FLOP/s."""
    return Network(
        cluster.intra_node,
        cluster.inter_node,
        cluster.gpus_per_node,
        gpus_per_rank=tp * cp * dp,
        tensor_parallel=tp,
        context_parallel=cp,
        flops_per_gpu=costs.flops_per_gpu,
    )


@dataclass(frozen=True)
class _Step:
    seconds: float
    bubble_ratio: float


@cache
def _simulated_step(
    choice: ScheduleChoice,
    pp: int,
    tp: int,
    dp: int,
    ac: ACMode,
    microbatches: int,
    job: Job,
    cluster: Cluster,
    costs: _Costs,
    cp: int = 1,
) -> _Step:
    """A step's time, simulated at N' = min(N, 2p) and 2N' microbatches and extended to N
    (each microbatch past the warm-up adds the same time); at N alone where N <= 4p."""
    network = _network(cluster, costs, tp, cp, dp)
    config = SimConfig(
        choice.schedule,
        pp,
        microbatches,
        choice.num_subsequences,
        stages_per_rank=choice.stages_per_rank,
        flavor=job.flavor,
        seq_len=job.seq_len,
        partition=choice.partition,
        network=network,
        recompute=_RECOMPUTE[ac],
        torch_lowering=False,
        unit_overhead=costs.unit_overhead_s,
        length_multiple=job.length_multiple,
    )
    config = replace(config, cost=costs.cost_for(choice, pp, subsequence_lengths(config)))
    unit = seconds_per_time_unit(config)

    def run(n: int) -> tuple[float, float]:
        result = simulate(replace(config, microbatches=n))
        if result.deadlock:
            raise ValueError(result.deadlock.describe())
        busy = max(busy_and_end(ivs)[0] for ivs in result.timeline.values())
        return result.makespan * unit, busy * unit

    small = min(microbatches, 2 * pp)
    if small == microbatches:
        makespan, busy = run(small)
    else:
        twice = min(microbatches, 2 * small)
        longer, busy_longer = run(twice)
        # Where 2N' is N the line ends where it starts, whatever its slope: N' is not simulated.
        slope = 0.0 if twice == microbatches else (longer - run(small)[0]) / (twice - small)
        makespan, busy = longer + slope * (microbatches - twice), busy_longer * microbatches / twice
    return _Step(makespan, 1 - busy / makespan)


@cache
def _runs(choice: ScheduleChoice, pp: int, microbatches: int, n_layers: int) -> bool:
    """Whether the schedule can run this choice (the errors a job check would give)."""
    if pp * choice.stages_per_rank // choice.parameter_copies > n_layers:
        return False  # a chunk without a layer
    try:
        if choice.parameter_copies > 1:  # the two-chain schedules check a shape without building its lists
            SEQUENCE_SCHEDULES[choice.schedule].check_shape(ScheduleShape(pp, microbatches, choice.num_subsequences))
        else:  # the lists, built once: the simulation and the memory model take them again at N <= 2p
            build(
                SimConfig(
                    choice.schedule, pp, microbatches, choice.num_subsequences, stages_per_rank=choice.stages_per_rank
                )
            )
    except ValueError:
        return False
    return True


def _memory_config(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int, ac: ACMode, cp: int
) -> MemoryConfig:
    return MemoryConfig(
        job.flavor,
        job.shape(choice, tp, cp),
        choice.schedule,
        pp,
        dp_shard=cluster.gpus // (pp * tp * cp),
        activation_checkpoint=ac,
        device=cluster.device,
    )


def memory(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int, ac: ACMode, cp: int = 1
) -> MemoryEstimate:
    """The memory model's estimate for ``choice`` on a (pp, tp, cp, rest data-parallel) split."""
    return predict_memory(_memory_config(job, cluster, choice, pp, tp, ac, cp))


def evaluate(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int = 1, ac: ACMode = "none", cp: int = 1
) -> Plan:
    """One configuration's predicted throughput, bubble and peak memory (what the search ranks)."""
    args = flavor_shape(job.flavor)
    costs = _Costs.load(job, cluster, args)
    dp = cluster.gpus // (pp * tp * cp)
    peak = gib(memory(job, cluster, choice, pp, tp, ac, cp).total)
    c = _Candidate(choice, pp, tp, dp, ac, math.inf, cp)
    return _measure(c, job, cluster, costs, args, peak, peak <= cluster.gpu_memory_gib)


def _measure(c: _Candidate, job: Job, cluster: Cluster, costs: _Costs, args, peak_gib: float, fits: bool) -> Plan:
    n = job.local_batch_size
    step = _simulated_step(c.choice, c.pp, c.tp, c.dp, c.ac, n, job, cluster, costs, c.cp)
    seconds = step.seconds + n * _tp_seconds(args, job.seq_len / c.cp, c.pp, c.tp, _RECOMPUTE[c.ac], cluster)
    return _plan_of(c, job, c.dp * n * job.seq_len / seconds, peak_gib, step.bubble_ratio, fits)


def _plan_of(c: _Candidate, job: Job, tokens_per_s: float, peak_gib: float, bubble_ratio: float, fits: bool) -> Plan:
    """The plan of candidate ``c`` with what the models predict for it."""
    choice = c.choice
    return Plan(
        choice.schedule,
        c.pp,
        c.tp,
        c.dp,
        choice.num_subsequences,
        choice.partition,
        choice.stages_per_rank,
        c.ac,
        tokens_per_s,
        peak_gib,
        bubble_ratio,
        fits,
        tuple(job.shape(choice, c.tp, c.cp).lengths),
        job.length_multiple,
        c.cp,
    )


def _lengths(job: Job, choice: ScheduleChoice, tp: int, cp: int = 1) -> list[int] | None:
    """The cut of ``choice`` at TP ``tp`` and CP ``cp``, None where there is none (seq_len not a
    multiple of lcm(length_multiple, tp, 2 cp tp), fewer pieces than k, or CP with torch's schedules)."""
    if cp > 1 and choice.schedule not in SEQUENCE_SCHEDULES:
        return None
    try:
        return job.shape(choice, tp, cp).lengths
    except ValueError:
        return None


def _candidates(
    choice: ScheduleChoice,
    by_pp: dict[int, list[tuple[int, int, int]]],
    job: Job,
    cluster: Cluster,
    costs: _Costs,
    args,
    cost: UnitCost,
) -> list[_Candidate]:
    """``choice`` on every mesh and AC mode that can cut the sequence, with its bound (whether the
    schedule runs on the mesh's pp is asked of the candidates the search visits: :func:`_runs`)."""
    n, out = job.local_batch_size, []
    degrees = {(tp, cp): dp for splits in by_pp.values() for tp, cp, dp in splits}
    cuts = {key: lengths for key in degrees if (lengths := _lengths(job, choice, *key)) is not None}
    # Per layer, CP's K/V collectives of a step's units: an all-gather in each forward, a
    # reduce-scatter in each backward.
    kv_per_layer = {}
    for (tp, cp), lengths in cuts.items():
        network = _network(cluster, costs, tp, cp, degrees[tp, cp])
        kv_per_layer[tp, cp] = 2 * n * sum(network.kv_collective_seconds(args, length) for length in lengths)
    units = {(key, ac): _unit_flops(cost, lengths, _RECOMPUTE[ac]) for key, lengths in cuts.items() for ac in AC_MODES}
    for pp, splits in by_pp.items():
        for ac in AC_MODES:
            r = _RECOMPUTE[ac]
            for tp, cp, dp in splits:
                if (tp, cp) not in cuts:
                    continue
                lengths, rate, u = cuts[tp, cp], tp * cp * costs.flops_per_gpu, units[(tp, cp), ac]
                # Every rank runs N k units on its n_layers / pp layers, each at the fixed cost (a CP
                # rank too: it runs every unit, on 1/c of its tokens) and CP's collectives; the step
                # is no shorter than one microbatch's chain of passes either.
                work = n * _step_flops(u, args.n_layers, pp) + _fill_flops(choice, u, args.n_layers, pp)
                fixed = n * len(lengths) * args.n_layers / pp * costs.unit_overhead_s
                busy = work / rate + fixed + kv_per_layer[tp, cp] * args.n_layers / pp
                step = max(busy, _path_flops(choice, u, args.n_layers, pp) / rate)
                seconds = step + n * _tp_seconds(args, job.seq_len / cp, pp, tp, r, cluster)
                out.append(_Candidate(choice, pp, tp, dp, ac, dp * n * job.seq_len / seconds, cp))
    return out


@contextlib.contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while (as it was after). The search makes
    millions of small acyclic objects (actions, steps, tuples), which reference counting frees;
    each of the collections they would set off walks every live object, torch's own included,
    which took a third of the planner's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan(job: Job, cluster: Cluster, top: int = 10, processes: int | None = None) -> list[Plan]:
    """The ``top`` fastest configurations that fit, best first, followed by the three
    configurations closest to fitting when fewer fit.

    ``processes``: how many the search runs in at most (:mod:`~torchtitan_seq.lookahead`; the same
    plans in any number), and no more than one per CPU; default 4.

    Raises ValueError, naming the setting, for an unknown flavor, GPU counts no
    degrees divide, or a memory budget nothing fits.
    """
    if processes is not None and processes < 1:
        raise ValueError(f"--processes {processes}: at least 1")
    with _without_cycle_collection():
        return _search(job, cluster, top, min(processes or 4, available_processes()))


def _search(job: Job, cluster: Cluster, top: int, processes: int) -> list[Plan]:
    """:func:`plan`'s search (see the module docstring)."""
    if (args := flavor_shape(job.flavor)) is None:
        raise ValueError(f"--flavor {job.flavor!r} does not exist: use one of {sorted(flavor_shapes)}")
    if min(job.seq_len - 1, job.local_batch_size, job.length_multiple, cluster.gpu_memory_gib) <= 0:
        raise ValueError(
            "--seq-len, --local-batch-size, --length-multiple and --gpu-memory-gib must be positive "
            "(seq-len at least 2)"
        )
    costs = _Costs.load(job, cluster, args)
    cost = UnitCost.from_model_args(args)
    by_pp: dict[int, list[tuple[int, int, int]]] = {}
    for pp, tp, cp, dp in _meshes(job, cluster, args):
        by_pp.setdefault(pp, []).append((tp, cp, dp))
    candidates = [c for choice in CHOICES for c in _candidates(choice, by_pp, job, cluster, costs, args, cost)]
    # Best bound first. A configuration is slower than one with no more TP, no more CP and no more
    # recomputation (its bound is lower, so that one mostly comes first): once one fits, the
    # heavier ones of its schedule and pp are skipped, or dropped where a near tie of bounds
    # visited one first. Memory is only asked of what is visited.
    candidates.sort(key=lambda c: -c.bound)
    fitting: list[tuple[Plan, tuple[ScheduleChoice, int], tuple[int, int, int]]] = []
    kept = _Kept()
    check = _MemoryCheck(job, cluster, by_pp)

    def visit(i: int) -> Plan | None:
        """Candidate i measured where it runs and fits, else None."""
        c = candidates[i]
        if not _runs(c.choice, c.pp, job.local_batch_size, args.n_layers) or (need := check.need(c)) is None:
            return None
        return _measure(c, job, cluster, costs, args, need, True)

    with Lookahead.start(_shares(candidates, processes), _ahead(candidates, visit), processes) as ahead:
        for i, c in enumerate(candidates):
            if len(fitting) >= top and c.bound < fitting[top - 1][0].tokens_per_s:
                break
            if kept.skips(c) or (measured := ahead.answer(i, visit)) is None:
                continue
            key, degrees = kept.keep(c)
            fitting = [f for f in fitting if f[1] != key or not _no_heavier(degrees, f[2])]  # no heavier twin
            fitting.append((measured, key, degrees))
            fitting.sort(key=lambda f: -f[0].tokens_per_s)
    if ahead.forked and len(fitting) < top:
        # The rows that do not fit come from the misses met in the order of one process.
        return _search(job, cluster, top, processes=1)
    closest = check.closest() if len(fitting) < top else []
    if not fitting:
        need, c = closest[0]
        raise ValueError(
            f"--gpu-memory-gib {cluster.gpu_memory_gib:g}: nothing fits; the smallest configuration "
            f"({c.choice.schedule}, pp {c.pp}, tp {c.tp}{f', cp {c.cp}' if c.cp > 1 else ''}, "
            f"k {c.choice.num_subsequences}, activation "
            f"checkpointing {c.ac}) needs {need:.1f} GiB per GPU"
        )
    over = [_plan_of(c, job, math.nan, need, math.nan, False) for need, c in closest]
    return [plan for plan, _, _ in fitting[:top]] + over


def _no_heavier(lighter: tuple[int, int, int], degrees: tuple[int, int, int]) -> bool:
    """Whether degrees (TP, CP, AC mode) ``lighter`` are nowhere more than ``degrees``."""
    return all(map(int.__le__, lighter, degrees))


class _Kept:
    """The degrees (TP, CP, AC mode) of the candidates kept, per schedule choice and p: a candidate
    with a kept twin no heavier than it is skipped."""

    def __init__(self) -> None:
        self.degrees: dict[tuple[ScheduleChoice, int], list[tuple[int, int, int]]] = {}

    @staticmethod
    def _twins(c: _Candidate) -> tuple[tuple[ScheduleChoice, int], tuple[int, int, int]]:
        return (c.choice, c.pp), (c.tp, c.cp, AC_MODES.index(c.ac))

    def skips(self, c: _Candidate) -> bool:
        key, degrees = self._twins(c)
        return any(_no_heavier(lighter, degrees) for lighter in self.degrees.get(key, []))

    def keep(self, c: _Candidate) -> tuple[tuple[ScheduleChoice, int], tuple[int, int, int]]:
        """Keep ``c``; returns its schedule choice and p, and its degrees."""
        key, degrees = self._twins(c)
        self.degrees.setdefault(key, []).append(degrees)
        return key, degrees


def _shares(candidates: list[_Candidate], processes: int) -> list[int]:
    """Per candidate, the process that visits it: schedule shapes (schedule, k, v, p) dealt round
    the processes in the order the search first meets them, so that a shape's lists, their
    preparation for timing and the memory model's walks are built in one process only."""
    order: dict[tuple, int] = {}
    shape = [(c.choice.schedule, c.choice.num_subsequences, c.choice.stages_per_rank, c.pp) for c in candidates]
    return [order.setdefault(s, len(order)) % processes for s in shape]


def _ahead(candidates: list[_Candidate], visit: Callable[[int], Plan | None]) -> Callable[[int], object]:
    """A helper's work: visit the candidates of its share, skipping as the search skips the heavier
    twins of those that fit (it goes on past where the search stops, until stopped)."""
    kept = _Kept()

    def work(i: int) -> object:
        if kept.skips(candidates[i]):
            return SKIP
        if (measured := visit(i)) is not None:
            kept.keep(candidates[i])
        return measured

    return work


_Group = tuple[ScheduleChoice, int, int]
"""(choice, pp, cp): candidates that differ only in TP and AC."""


@dataclass
class _Miss:
    """A configuration met that does not fit: ``gib`` its estimate's need, or a floor of it."""

    gib: float
    exact: bool
    candidate: _Candidate
    group: _Group | None = None
    """A candidate's group: the miss counts only where the group's lightest fits (else the search
    skips the candidate and counts the lightest); None: a lightest."""


class _MemoryCheck:
    """Whether the search's candidates fit, asking the memory model as little as the answer needs.

    A group's lightest candidate (most TP, full AC) is taken to need the least: where it does not
    fit, no candidate of the group is kept, and the lightest, not the candidate, counts as met
    (:meth:`closest`). Every need is first weighed against the memory model's floor
    (:func:`~torchtitan_seq.simulate.memory.memory_floor`), which most candidates exceed by far,
    and the estimate taken only where the floor fits; a group's lightest is estimated only once a
    candidate of it fits (what the first visit would have met is worked out in :meth:`closest`)."""

    def __init__(self, job: Job, cluster: Cluster, by_pp: dict[int, list[tuple[int, int, int]]]) -> None:
        self.job, self.cluster, self.by_pp = job, cluster, by_pp
        self.met: list[_Miss] = []
        """Misses in the order met; a group's lightest at the group's first candidate."""
        self.lightest: dict[_Group, tuple[_Candidate, float | None]] = {}
        """Per group met, its lightest and its need: None until estimated, inf where its floor is over."""

    def _config(self, c: _Candidate) -> MemoryConfig:
        return _memory_config(self.job, self.cluster, c.choice, c.pp, c.tp, c.ac, c.cp)

    def _estimate(self, c: _Candidate) -> float:
        return gib(predict_memory(self._config(c)).total)

    def need(self, c: _Candidate) -> float | None:
        """The GiB per GPU ``c`` needs where it and its group's lightest fit the budget, else None."""
        budget, group = self.cluster.gpu_memory_gib, (c.choice, c.pp, c.cp)
        if group not in self.lightest:
            tp, dp = [
                (t, d) for t, q, d in self.by_pp[c.pp] if q == c.cp and _lengths(self.job, c.choice, t, q) is not None
            ][-1]
            light = replace(c, tp=tp, dp=dp, ac="full")
            floor = gib(memory_floor(self._config(light)))
            self.lightest[group] = light, (math.inf if floor > budget else None)
            self.met.append(_Miss(floor, False, light))
        light, light_need = self.lightest[group]
        if light_need == math.inf:
            return None
        config = self._config(c)
        floor = gib(memory_floor(config))
        if floor <= budget:
            floor = gib(memory_floor(config, walked=True))
        if floor > budget:
            self.met.append(_Miss(floor, False, c, group))
            return None
        if (need := self._estimate(c)) > budget:
            self.met.append(_Miss(need, True, c, group))
            return None
        if light_need is None:
            light_need = self._lightest_need(group)
        return need if light_need <= budget else None

    def _lightest_need(self, group: _Group) -> float:
        light, need = self.lightest[group]
        if need is None or need == math.inf:
            need = self._estimate(light)
            self.lightest[group] = light, need
        return need

    def closest(self) -> list[tuple[float, _Candidate]]:
        """The three configurations met closest to fitting, with their needs (ties: the first met first):
        misses in ascending order of need or floor, estimated while one may still beat the third."""
        budget, best = self.cluster.gpu_memory_gib, []
        for low, i in sorted((miss.gib, i) for i, miss in enumerate(self.met)):
            if len(best) == 3 and low > best[-1][0]:
                break
            miss = self.met[i]
            if miss.group is None:  # a lightest: met where it does not fit
                need = self._lightest_need((miss.candidate.choice, miss.candidate.pp, miss.candidate.cp))
            elif self._lightest_need(miss.group) > budget:
                continue  # the search skipped the candidate: its lightest does not fit
            else:
                need = miss.gib if miss.exact else self._estimate(miss.candidate)
            if need > budget:
                best = sorted([*best, (need, i, miss.candidate)], key=lambda x: x[:2])[:3]
        return [(need, c) for need, _, c in best]


def _table(plans: list[Plan]) -> str:
    head = "| # | schedule | pp | tp | cp | dp_shard | k | partition | v | AC | tokens/s | peak GiB | bubble | fits |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, p in enumerate(plans, 1):
        rows.append(
            f"| {i} | {p.schedule} | {p.pp} | {p.tp} | {p.cp} | {p.dp_shard} | {p.num_subsequences} | {p.partition} | "
            f"{p.stages_per_rank} | {p.activation_checkpoint} | {p.tokens_per_s:,.0f} | {p.peak_memory_gib:.1f} | "
            f"{p.bubble_ratio:.3f} | {'yes' if p.fits else 'no'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_seq.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", required=True, help="a llama3_seq flavor, e.g. 8B, 70B, debugmodel")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, required=True)
    parser.add_argument(
        "--local-batch-size",
        type=int,
        required=True,
        help="sequences per data-parallel rank and step (one per microbatch)",
    )
    parser.add_argument("--tp", type=int, help="fix the TP degree (default: search 1, 2, 4, 8)")
    parser.add_argument("--cp", type=int, help="fix the CP degree of sequence schedules (default: search 1, 2, 4, 8)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--length-multiple",
        type=int,
        default=LENGTH_MULTIPLE,
        help="sequence_pipeline.length_multiple: every subsequence length a multiple of it and of "
        "the TP degree (default %(default)s)",
    )
    parser.add_argument(
        "--tflops",
        type=float,
        default=Cluster.flops_per_gpu / 1e12,
        help="achieved TFLOP/s per GPU of the cost model (default %(default)g)",
    )
    parser.add_argument(
        "--unit-overhead-ms",
        type=float,
        default=Cluster.unit_overhead_s * 1e3,
        help="fixed ms per unit (forward + backward) and layer on top of the cost model "
        "(default %(default)g: measured on an H200)",
    )
    parser.add_argument(
        "--cost",
        type=Path,
        action="append",
        default=[],
        help="a calibration file (benchmarks/bench.py --calibrate), repeatable, or a folder of them",
    )
    parser.add_argument("--top", type=int, default=10, help="rows of the table (default %(default)s)")
    parser.add_argument(
        "--processes",
        type=int,
        default=4,
        help="search in up to this many processes, one per CPU at most; the same plans (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object: plans and overrides")
    a = parser.parse_args(argv)
    costs = tuple(f for path in a.cost for f in (sorted(path.glob("cost_*.json")) if path.is_dir() else [path]))
    job = Job(a.flavor, a.seq_len, a.local_batch_size, a.tp, costs, a.length_multiple, a.cp)
    cluster = Cluster(
        a.gpus, a.gpu_memory_gib, a.gpus_per_node, a.tflops * 1e12, unit_overhead_s=a.unit_overhead_ms / 1e3
    )
    try:
        plans = plan(job, cluster, a.top, a.processes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = plans[0]
    overrides = best.overrides(job.flavor, job.seq_len, job.local_batch_size)
    if a.json:
        print(json.dumps({"plans": [asdict(p) for p in plans], "overrides": overrides}, indent=1))
        return 0
    print(
        f"{job.flavor}, seq {job.seq_len}, {cluster.gpus} GPUs of {cluster.gpu_memory_gib:g} GiB, "
        f"local batch {job.local_batch_size}; "
        + ("measured costs\n" if costs else f"transformer-model costs, {a.unit_overhead_ms:g} ms per unit and layer\n")
    )
    print(_table(plans))
    print(f"\nBest, as ./run_train.sh overrides:\n  ./run_train.sh {overrides}\n")
    print("As TOML:\n\n" + best.toml(job.flavor, job.seq_len, job.local_batch_size))
    return 0


if __name__ == "__main__":
    code = main()  # the cyclic collector off since the imports (see the top); plan() leaves it so
    # Out without the interpreter's teardown, which frees the search's cached action lists one object at
    # a time (1-2 s after the answer); the planner holds nothing else to release.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
