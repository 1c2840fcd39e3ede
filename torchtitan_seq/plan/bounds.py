"""The search's candidates and their bounds: the splits of the GPUs into (pp, tp, cp, dp_shard), the
cuts of the sequence, and per candidate the tokens/s no simulation of it can beat (see the
package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_seq.plan.choices import AC_MODES, CP_DEGREES, RECOMPUTE, TP_DEGREES, ScheduleChoice
from torchtitan_seq.plan.costs import Costs, step_network, tp_seconds
from torchtitan_seq.plan.flops import fill_flops, path_flops, step_flops, unit_flops
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.runtime.partition import UnitCost
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.memory import ACMode
from torchtitan_seq.titan.flavors import ModelShape


@dataclass(frozen=True)
class Candidate:
    choice: ScheduleChoice
    pp: int
    tp: int
    dp: int
    ac: ACMode
    bound: float
    cp: int = 1
    """tokens/s without bubbles or transfers under the cost model: what the simulation
    can at best reach (with measured costs, about)."""


def candidate_meshes(job: Job, cluster: Cluster, args: ModelShape) -> list[tuple[int, int, int, int]]:
    """(pp, tp, cp, dp_shard) splits of the GPUs: TP within a node and dividing the heads, pp >= 2, and each
    pipeline rank's GPUs (tp cp dp_shard) within one node or on whole nodes: the network model
    (:class:`~torchtitan_seq.simulate.network.Network`) cannot place a rank over part of a node, so a
    split such as pp 8 of 96 GPUs on nodes of 8 (12 GPUs a rank) is not searched."""
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
        if cluster.gpus % (pp * tp * cp) == 0 and _placed(cluster.gpus // pp, cluster.gpus_per_node)
    ]
    if not meshes:
        raise ValueError(
            f"--gpus {cluster.gpus}: no pipeline degree of at least 2 divides it with TP {tps} "
            f"(and at most the {args.n_layers} layers of {job.flavor}, each pipeline rank's GPUs within a node of "
            f"{cluster.gpus_per_node} or on whole nodes): use a multiple of 2 x TP"
        )
    return meshes


def _placed(gpus_per_rank: int, gpus_per_node: int) -> bool:
    """Whether the network model places a pipeline rank of ``gpus_per_rank`` GPUs: one of it and a node
    a multiple of the other."""
    return gpus_per_rank % gpus_per_node == 0 or gpus_per_node % gpus_per_rank == 0


def cut_lengths(job: Job, choice: ScheduleChoice, tp: int, cp: int = 1) -> list[int] | None:
    """The cut of ``choice`` at TP ``tp`` and CP ``cp``, None where there is none (seq_len not a
    multiple of lcm(length_multiple, tp, 2 cp tp), fewer pieces than k, or CP with torch's schedules)."""
    if cp > 1 and choice.schedule not in SEQUENCE_SCHEDULES:
        return None
    try:
        return job.shape(choice, tp, cp).lengths
    except ValueError:
        return None


def candidates_of(
    choice: ScheduleChoice,
    by_pp: dict[int, list[tuple[int, int, int]]],
    job: Job,
    cluster: Cluster,
    costs: Costs,
    args: ModelShape,
    cost: UnitCost,
) -> list[Candidate]:
    """``choice`` on every mesh and AC mode that can cut the sequence, with its bound (whether the
    schedule runs on the mesh's pp is asked of the candidates the search visits: :func:`schedule_runs`)."""
    n, out = job.local_batch_size, []
    degrees = {(tp, cp): dp for splits in by_pp.values() for tp, cp, dp in splits}
    cuts = {key: lengths for key in degrees if (lengths := cut_lengths(job, choice, *key)) is not None}
    # Per layer, CP's K/V collectives of a step's units: an all-gather in each forward, a
    # reduce-scatter in each backward.
    kv_per_layer = {}
    for (tp, cp), lengths in cuts.items():
        network = step_network(cluster, costs, tp, cp, degrees[tp, cp])
        kv_per_layer[tp, cp] = 2 * n * sum(network.kv_collective_seconds(args, length) for length in lengths)
    units = {(key, ac): unit_flops(cost, lengths, RECOMPUTE[ac]) for key, lengths in cuts.items() for ac in AC_MODES}
    for pp, splits in by_pp.items():
        for ac in AC_MODES:
            r = RECOMPUTE[ac]
            for tp, cp, dp in splits:
                if (tp, cp) not in cuts:
                    continue
                lengths, rate, u = cuts[tp, cp], tp * cp * costs.flops_per_gpu, units[(tp, cp), ac]
                # Every rank runs N k units on its n_layers / pp layers, each at the fixed cost (a CP
                # rank too: it runs every unit, on 1/c of its tokens) and CP's collectives; the step
                # is no shorter than one microbatch's chain of passes either.
                work = n * step_flops(u, args.n_layers, pp) + fill_flops(choice, u, args.n_layers, pp)
                fixed = n * len(lengths) * args.n_layers / pp * costs.unit_overhead_s
                busy = work / rate + fixed + kv_per_layer[tp, cp] * args.n_layers / pp
                step = max(busy, path_flops(choice, u, args.n_layers, pp) / rate)
                seconds = step + n * tp_seconds(args, job.seq_len / cp, pp, tp, r, cluster)
                out.append(Candidate(choice, pp, tp, dp, ac, dp * n * job.seq_len / seconds, cp))
    return out
