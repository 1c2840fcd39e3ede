"""A configuration measured: its step simulated at a few microbatches and extended to the job's,
TP's collectives added, and the plan it makes; :func:`evaluate` for one configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from torchtitan_seq.instrumentation.render import busy_and_end
from torchtitan_seq.plan.bounds import Candidate
from torchtitan_seq.plan.choices import RECOMPUTE, ScheduleChoice
from torchtitan_seq.plan.costs import Costs, step_network, tp_seconds
from torchtitan_seq.plan.flops import latent_flops
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.memory_check import KVOption, kv_options, memory, memory_config
from torchtitan_seq.plan.record import Plan
from torchtitan_seq.runtime.model_counts import kv_values
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.simulate.build import SimConfig, build
from torchtitan_seq.simulate.costs import seconds_per_time_unit, subsequence_lengths
from torchtitan_seq.simulate.engine import simulate
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import ACMode, dtype_bytes, gib
from torchtitan_seq.simulate.offload import offload_delays
from torchtitan_seq.titan.flavors import ModelShape


@dataclass(frozen=True)
class Step:
    seconds: float
    bubble_ratio: float


@cache
def simulated_step(
    choice: ScheduleChoice,
    pp: int,
    tp: int,
    dp: int,
    ac: ACMode,
    microbatches: int,
    job: Job,
    cluster: Cluster,
    costs: Costs,
    cp: int = 1,
    offload: bool = False,
    latent: bool = False,
) -> Step:
    """A step's time, simulated at N' = min(N, 2p) and 2N' microbatches and extended to N
    (each microbatch past the warm-up adds the same time); at N alone where N <= 4p. ``offload``: with
    ``kv_offload``'s copies over the cluster's host link (:func:`~torchtitan_seq.simulate.offload.offload_delays`);
    ``latent``: with MLA's prefix expansion on each rank's layers (:func:`latent_seconds`)."""
    network = step_network(cluster, costs, tp, cp, dp)
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
        recompute=RECOMPUTE[ac],
        torch_lowering=False,
        unit_overhead=costs.unit_overhead_s,
        length_multiple=job.length_multiple,
    )
    config = replace(config, cost=costs.cost_for(choice, pp, subsequence_lengths(config)))
    unit = seconds_per_time_unit(config)
    position = offload_position_bytes(job, cluster, choice, pp, tp, ac, cp) if offload else 0.0

    def run(n: int) -> tuple[float, float]:
        result = simulate(replace(config, microbatches=n))
        if result.deadlock:
            raise ValueError(result.deadlock.describe())
        busy = max(busy_and_end(ivs)[0] for ivs in result.timeline.values())
        link = cluster.host_link
        delay = max(offload_delays(result, position / link.bandwidth / unit, link.latency / unit)) if offload else 0.0
        return (result.makespan + delay) * unit, busy * unit

    small = min(microbatches, 2 * pp)
    if small == microbatches:
        makespan, busy = run(small)
    else:
        twice = min(microbatches, 2 * small)
        longer, busy_longer = run(twice)
        # Where 2N' is N the line ends where it starts, whatever its slope: N' is not simulated.
        slope = 0.0 if twice == microbatches else (longer - run(small)[0]) / (twice - small)
        makespan, busy = longer + slope * (microbatches - twice), busy_longer * microbatches / twice
    if latent:
        expansion = latent_seconds(job, costs, subsequence_lengths(config), pp, tp, RECOMPUTE[ac], microbatches)
        makespan, busy = makespan + expansion, busy + expansion
    return Step(makespan, 1 - busy / makespan)


def latent_seconds(
    job: Job, costs: Costs, lengths: list[int], pp: int, tp: int, recompute: float, microbatches: int
) -> float:
    """Seconds a rank spends on MLA's prefix expansion under ``kv_context = "latent"`` in a step
    (:func:`~torchtitan_seq.plan.flops.latent_flops` on its 1/pp of the layers, its 1/tp of the heads), at the
    cost model's FLOP/s. Added to the step whole: the cut does not balance it, and it runs on every rank."""
    args = flavor_shape(job.flavor)
    per_layer = latent_flops(args.mla, args.n_heads, lengths, recompute) / tp
    return microbatches * args.n_layers / pp * per_layer / costs.flops_per_gpu


def offload_position_bytes(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int, ac: ACMode, cp: int
) -> float:
    """Bytes of K/V one position of a stage's arena holds over the stage's layers (each rank's share)."""
    config = memory_config(job, cluster, choice, pp, tp, ac, cp)
    stages = pp * choice.stages_per_rank // choice.parameter_copies
    return (
        kv_values(config.model_args)
        / tp
        * dtype_bytes(config.activation_dtype, "compute_dtype")
        * (config.model_args.n_layers / stages)
    )


@cache
def schedule_runs(choice: ScheduleChoice, pp: int, microbatches: int, n_layers: int) -> bool:
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


def evaluate(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int = 1, ac: ACMode = "none", cp: int = 1
) -> Plan:
    """One configuration's predicted throughput, bubble and peak memory (what the search ranks).

    Args:
        job: what is trained.
        cluster: the GPUs it may use.
        choice: the schedule and its settings.
        pp: the pipeline degree.
        tp: the TP degree.
        ac: the activation checkpointing mode.
        cp: the CP degree; the data-parallel degree is what the GPUs leave.

    Returns:
        The configuration's plan, ``fits`` saying whether its peak fits ``cluster.gpu_memory_gib`` (under the
        first K/V option of :func:`~torchtitan_seq.plan.memory_check.kv_options` with which it fits, else
        the lightest).
    """
    args = flavor_shape(job.flavor)
    costs = Costs.load(job, cluster, args)
    dp = cluster.gpus // (pp * tp * cp)
    # as the search: the first K/V option that fits, else the lightest
    for option in kv_options(job, choice, cp):
        peak = gib(memory(job, cluster, choice, pp, tp, ac, cp, option).total)
        if peak <= cluster.gpu_memory_gib:
            break
    c = Candidate(choice, pp, tp, dp, ac, math.inf, cp)
    return measure_candidate(c, job, cluster, costs, args, peak, peak <= cluster.gpu_memory_gib, option)


def measure_candidate(
    c: Candidate,
    job: Job,
    cluster: Cluster,
    costs: Costs,
    args: ModelShape,
    peak_gib: float,
    fits: bool,
    option: KVOption | None = None,
) -> Plan:
    """Candidate ``c``'s plan, its step simulated under the K/V settings ``option`` (None: the job's)."""
    option = option or KVOption(job.kv_context)
    n = job.local_batch_size
    latent = option.kv_context == "latent"
    step = simulated_step(c.choice, c.pp, c.tp, c.dp, c.ac, n, job, cluster, costs, c.cp, option.offload, latent)
    seconds = step.seconds + n * tp_seconds(args, job.seq_len / c.cp, c.pp, c.tp, RECOMPUTE[c.ac], cluster)
    return plan_of(c, job, c.dp * n * job.seq_len / seconds, peak_gib, step.bubble_ratio, fits, option)


def plan_of(
    c: Candidate, job: Job, tokens_per_s: float, peak_gib: float, bubble_ratio: float, fits: bool, option: KVOption
) -> Plan:
    """The plan of candidate ``c`` with what the models predict for it, under the K/V settings ``option``."""
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
        option.kv_context,
        option.offload,
    )
