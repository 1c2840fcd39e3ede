"""The planner's candidates, plans and model inputs against a brute force of this file's own.

:mod:`test_planner_exhaustive` evaluates what the planner's own candidate generation yields, so a
mesh or schedule choice the search never generates would be missing from both sides. Here the
candidates come from first principles and the planner's documented promises (:func:`_brute_force`:
every split of the GPUs, schedule, k, partition and AC mode, the rules of a cut and of a schedule's
shape written out again), sharing no candidate-generation code with the planner;
:func:`planner.evaluate` only scores them. Three properties:

- the candidates the search generates and would visit (its ``candidates_of`` on its meshes and
  schedule choices, then ``schedule_runs``) are the brute force's, on a wide grid of shapes (no evaluation);
- the top N of :func:`planner.plan` are the first N rows of the brute force's table (every candidate
  evaluated; the fitting ones without a fitting lighter twin, fastest first);
- the memory model's configuration and the simulator's input the planner builds for a candidate are
  the ones built here from the candidate alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from unittest import mock

import pytest
from test_planner_exhaustive import assert_top_plans

from torchtitan_seq import plan as planner
from torchtitan_seq.plan import measure, memory_check, search
from torchtitan_seq.runtime.partition import UnitCost, partition_sequence
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.costs import subsequence_lengths
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import MemoryConfig
from torchtitan_seq.simulate.network import Network

# What the planner promises to search, as this file's own literals. Where the space is narrower than
# first principles, on purpose, the reason is given.

TP_DEGREES = (1, 2, 4, 8)
"""``Job.tp``: "None searches 1, 2, 4, 8 within a node"; of these, first principles keep those that
fit a node and divide the query heads, the KV heads and the GPUs (every flavor's head counts are
powers of two, so no other degree divides them)."""

CP_DEGREES = (1, 2, 4, 8)
"""``Job.cp``: "None searches 1, 2, 4, 8" (a fixed ``--cp`` may be any divisor of the GPUs)."""

AC_MODES = ("none", "selective", "full")
"""Every ``activation_checkpoint.mode`` the memory model knows."""

TORCH_SCHEDULES = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2}
"""torch's schedules the planner searches, with their stages per rank (docs/planner.md: 2 for
Interleaved1F1B, else 1). They run each sequence whole: k 1, no CP. torch's other schedules (the
zero-bubble and looped ones) are not among the planner's."""

SEQUENCE_SPACE = {
    # schedule: (stages per rank, its (k, partition) pairs)
    "Seq1F1B": (1, tuple(itertools.product((2, 4, 8, 16), ("even", "compute")))),
    "InterleavedSeq1F1B": (2, tuple(itertools.product((2, 4, 8), ("even", "compute")))),
    "TeraPipe": (1, tuple((k, "latency") for k in (2, 4, 8))),
    "BSIPipe": (4, ((1, "even"), (2, "compute"), (4, "compute"))),
    "Chimera": (2, ((1, "even"), (2, "compute"), (4, "compute"))),
}
"""The sequence schedules' k and partitions: fewer than every k and partition, on purpose.

- k = 1 is left out where a torch schedule runs the same order on whole sequences (Seq1F1B's is
  1F1B, TeraPipe's GPipe, InterleavedSeq1F1B's Interleaved1F1B); the two-chain schedules have no
  torch twin, so their k = 1 is searched (every partition cuts one unit alike: 'even' stands for all);
- k is a power of two up to 16, 8 where a rank holds two chunks or TeraPipe's GPipe order holds every
  unit, 4 for the two-chain schedules (the longest lists to build): the fixed cost per unit makes many
  short units slower (docs/planner.md);
- a schedule's own partition ('compute', Seq1F1B's solver; 'latency', TeraPipe's slicing) and 'even'
  beside it; the two-chain schedules cut by cost only.

The stages per rank are each schedule's own, not searched (docs/planner.md)."""

CHAINS = {"BSIPipe": 2, "Chimera": 2}
"""Schedules that run two opposite chains, each over a full copy of the model (a rank holds v / 2
chunks of each); the others run one."""


def _placed(pp: int, cluster: planner.Cluster) -> bool:
    """Whether a pipeline rank's GPUs (tp cp dp, the GPUs / pp) share one node or fill whole nodes. Narrower
    than what torchtitan runs, on purpose: the network model that times the transfers
    (:class:`~torchtitan_seq.simulate.network.Network`) places no pipeline rank over part of a node, so the
    planner does not search such a split (pp 8 of 96 GPUs on nodes of 8, say: 12 GPUs a rank)."""
    gpus_per_rank = cluster.gpus // pp
    return gpus_per_rank % cluster.gpus_per_node == 0 or cluster.gpus_per_node % gpus_per_rank == 0


def _unit_multiple(job: planner.Job, tp: int, cp: int) -> int:
    """What every unit length is a multiple of: ``length_multiple`` and the TP degree (sequence
    parallelism shards a unit's tokens TP ways), and under CP 2 cp tp (2 cp chunks, each sharded TP ways)."""
    return math.lcm(job.length_multiple, tp, 2 * cp * tp if cp > 1 else 1)


def _cuts(job: planner.Job, schedule: str, k: int, tp: int, cp: int) -> bool:
    """Whether the sequence cuts into k units, each a whole multiple of the unit multiple. torch's
    schedules run the sequence whole, one unit without CP (the job's shape asks no multiple of it)."""
    if schedule in TORCH_SCHEDULES:
        return cp == 1
    multiple = _unit_multiple(job, tp, cp)
    return job.seq_len % multiple == 0 and job.seq_len // multiple >= k


def _schedule_runs(schedule: str, v: int, p: int, n: int, n_layers: int) -> bool:
    """Whether ``schedule`` with v stages per rank runs on p ranks and N microbatches of a model of
    ``n_layers`` layers: every chunk of a chain (p v / chains of them) has a layer; the two-chain
    schedules pair rank q with rank p - 1 - q and share the microbatches between their chains (even p
    and N); torch's 1F1B warms up with a microbatch per stage (N >= p); torch's Interleaved1F1B splits
    the microbatches into max(1, N // p) rounds of as many each (N a multiple of the rounds)."""
    if p * v // CHAINS.get(schedule, 1) > n_layers:
        return False
    if schedule in CHAINS:
        return p % 2 == 0 and n % 2 == 0
    if schedule == "1F1B":
        return n >= p
    if schedule == "Interleaved1F1B":
        return n % max(1, n // p) == 0
    return True


def _schedule_space() -> list[tuple[str, int, str, int]]:
    """(schedule, k, partition, stages per rank) of every schedule choice the planner promises."""
    assert set(SEQUENCE_SPACE) == set(SEQUENCE_SCHEDULES), "a sequence schedule this file does not know"
    space = [(name, 1, "even", v) for name, v in TORCH_SCHEDULES.items()]
    return space + [(name, k, part, v) for name, (v, cuts) in SEQUENCE_SPACE.items() for k, part in cuts]


Key = tuple[str, int, str, int, int, int, int, int, str]
"""A candidate: (schedule, k, partition, stages per rank, pp, tp, cp, dp_shard, AC mode)."""


def _brute_force(job: planner.Job, cluster: planner.Cluster) -> set[Key]:
    """Every candidate of the job from first principles: pp tp cp dp = the GPUs; 2 <= pp <= the layers
    (a pipeline of at least two stages, each with a layer), a pipeline rank's GPUs placed on nodes
    (:func:`_placed`); TP within a node, dividing the query and the KV heads; the promised CP degrees
    (or the job's fixed TP and CP); every schedule choice that cuts the sequence and runs; every AC mode."""
    args = flavor_shape(job.flavor)
    heads = (args.n_heads, args.n_kv_heads or args.n_heads)
    gpus, n = cluster.gpus, job.local_batch_size
    tps = (
        [job.tp] if job.tp else [t for t in TP_DEGREES if t <= cluster.gpus_per_node and all(h % t == 0 for h in heads)]
    )
    cps = [job.cp] if job.cp else CP_DEGREES
    out = set()
    for tp, cp, pp in itertools.product(tps, cps, range(2, args.n_layers + 1)):
        if gpus % (pp * tp * cp) or not _placed(pp, cluster):
            continue
        dp = gpus // (pp * tp * cp)
        for schedule, k, part, v in _schedule_space():
            if _cuts(job, schedule, k, tp, cp) and _schedule_runs(schedule, v, pp, n, args.n_layers):
                out |= {(schedule, k, part, v, pp, tp, cp, dp, ac) for ac in AC_MODES}
    return out


def _choice(key: Key) -> planner.ScheduleChoice:
    return planner.ScheduleChoice(*key[:4])


def _evaluate(job: planner.Job, cluster: planner.Cluster, key: Key) -> planner.Plan:
    schedule, k, part, v, pp, tp, cp, dp, ac = key
    return planner.evaluate(job, cluster, _choice(key), pp, tp, ac, cp)


# (a) The candidates the search generates.


def _planner_candidates(job: planner.Job, cluster: planner.Cluster) -> set[Key] | None:
    """What the search generates (its ``candidates_of`` on its meshes and choices) and would visit (where
    ``schedule_runs``), taken from the search itself, stopped before it asks the memory model anything; None
    where it refuses the job."""

    class Generated(Exception):
        pass

    made = []
    candidates = search.candidates_of

    def recording(*args, **kwargs):
        out = candidates(*args, **kwargs)
        made.extend(out)
        return out

    def stop(*args, **kwargs):
        raise Generated

    with mock.patch.object(search, "candidates_of", recording), mock.patch.object(search, "MemoryCheck", stop):
        try:
            planner.plan(job, cluster, processes=1)
        except Generated:
            pass
        except ValueError:
            return None
    n_layers = flavor_shape(job.flavor).n_layers
    return {
        (c.choice.schedule, c.choice.num_subsequences, c.choice.partition, c.choice.stages_per_rank)
        + (c.pp, c.tp, c.cp, c.dp, c.ac)
        for c in made
        if search.schedule_runs(c.choice, c.pp, job.local_batch_size, n_layers)
    }


FLAVORS = ("debugmodel", "8B", "70B", "405B")
GPUS = (8, 16, 24, 64, 96, 256, 1024)
"""Powers of two and counts with a factor 3 (pp 3, 6, 12, ...; pipeline ranks that would straddle nodes)."""
NODES = (4, 8)
SEQ_LENS = (96, 2048, 32768, 131072)
"""96 tokens: too few for most cuts under TP and CP; the others cut into every k."""
BATCHES = (1, 3, 8, 16)
"""N below and above p, odd and even."""
FIXED = [
    planner.Job("8B", 32768, 8, tp=4),
    planner.Job("70B", 131072, 4, cp=16),
    planner.Job("debugmodel", 2048, 6, length_multiple=64),
    planner.Job("8B", 6144, 2, length_multiple=128, tp=2, cp=2),
]
"""Jobs with a fixed TP or CP degree, or a length multiple."""


def _set_grid(flavor: str) -> list[tuple[planner.Job, planner.Cluster]]:
    """Every GPU count on both node sizes; the sequence lengths and batches in turn (shifted per flavor, so
    that each flavor meets each of them), and the flavor's fixed jobs on 16, 64 and 96 GPUs."""
    f, grid = FLAVORS.index(flavor), []
    for i, (gpus, node) in enumerate(itertools.product(GPUS, NODES)):
        job = planner.Job(flavor, SEQ_LENS[(i + f) % len(SEQ_LENS)], BATCHES[(i // 2 + f) % len(BATCHES)])
        grid.append((job, planner.Cluster(gpus, 80, gpus_per_node=node)))
    fixed = [job for job in FIXED if job.flavor == flavor]
    return grid + [(job, planner.Cluster(gpus, 80, gpus_per_node=8)) for job in fixed for gpus in (16, 64, 96)]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_search_generates_every_candidate_of_the_brute_force_and_no_other(flavor):
    """On every GPU count, node size and sequence length of the grid (and fixed TP, CP and length multiples)."""
    for job, cluster in _set_grid(flavor):
        want, got = _brute_force(job, cluster), _planner_candidates(job, cluster)
        if got is None:  # the planner refuses the job: nothing can be cut and run
            assert len(want) == 0, (job, cluster.gpus, cluster.gpus_per_node, sorted(want)[:5])
            continue
        # counts, not the sets: pytest would diff sets of thousands of candidates line by line
        missing, extra = want - got, got - want
        assert (len(missing), len(extra)) == (0, 0), (
            f"{job}, {cluster.gpus} GPUs, nodes of {cluster.gpus_per_node}: "
            f"never generated {sorted(missing)[:5]}, not a candidate {sorted(extra)[:5]}"
        )


# (b) The best plans.

PLANS = [
    # (flavor, seq_len, local batch, GPUs, GPUs per node, unit overhead)
    ("debugmodel", 2048, 8, 8, 8, planner.H200_UNIT_OVERHEAD_S),
    ("debugmodel", 2048, 3, 64, 4, 0.0),
    ("debugmodel", 2048, 6, 96, 8, planner.H200_UNIT_OVERHEAD_S),
    ("debugmodel", 2048, 16, 1024, 8, planner.H200_UNIT_OVERHEAD_S),
    ("8B", 8192, 2, 16, 4, planner.H200_UNIT_OVERHEAD_S),
]
"""Cheap points, 1 to 3 s each (about 1 ms an evaluation, under 3,000 candidates): the debug model's
evaluations cost the same at any data-parallel degree."""
SLOW_PLANS = [
    ("8B", 32768, 4, 64, 8, planner.H200_UNIT_OVERHEAD_S),
    ("70B", 8192, 4, 64, 8, 0.0),
    ("8B", 131072, 2, 256, 4, planner.H200_UNIT_OVERHEAD_S),
    ("405B", 32768, 2, 128, 8, planner.H200_UNIT_OVERHEAD_S),
]
"""Points of 3,000 to 4,500 candidates and deeper pipelines: 4 to 9 s each."""


def _assert_plans_are_the_brute_force_table(flavor, seq_len, batch, gpus, node, overhead):
    """For top N in 1, 3, 10 and budgets loose (all fit), the median peak, the 5% quantile and too small (none fits)."""
    job = planner.Job(flavor, seq_len, batch)
    loose = planner.Cluster(gpus, 1e6, gpus_per_node=node, unit_overhead_s=overhead)
    # Evaluated once: a row's tokens/s and peak do not depend on the budget, only whether it fits.
    every = [_evaluate(job, loose, key) for key in sorted(_brute_force(job, loose))]
    peaks = sorted(p.peak_memory_gib for p in every)
    budgets = (2 * peaks[-1], peaks[len(peaks) // 2], peaks[len(peaks) // 20], 0.99 * peaks[0])
    assert_top_plans(job, loose, every, budgets, wider=False)


@pytest.mark.parametrize("flavor,seq_len,batch,gpus,node,overhead", PLANS)
def test_the_top_plans_are_the_first_rows_of_the_brute_force_table(flavor, seq_len, batch, gpus, node, overhead):
    _assert_plans_are_the_brute_force_table(flavor, seq_len, batch, gpus, node, overhead)


@pytest.mark.slow
@pytest.mark.parametrize("flavor,seq_len,batch,gpus,node,overhead", SLOW_PLANS)
def test_the_top_plans_of_large_models_are_the_first_rows_of_the_brute_force_table(
    flavor, seq_len, batch, gpus, node, overhead
):
    _assert_plans_are_the_brute_force_table(flavor, seq_len, batch, gpus, node, overhead)


# (c) The memory model's and the simulator's inputs.


def cut_lengths(job: planner.Job, schedule: str, k: int, part: str, tp: int, cp: int) -> list[int]:
    """The cut of a candidate: the whole sequence for torch's schedules, else k lengths of the partition,
    each a multiple of the unit multiple."""
    if schedule in TORCH_SCHEDULES:
        return [job.seq_len]
    cost = None if part == "even" else UnitCost.from_model_args(flavor_shape(job.flavor))
    return partition_sequence(job.seq_len, k, part, multiple=_unit_multiple(job, tp, cp), cost=cost)


def memory_config(job: planner.Job, cluster: planner.Cluster, key: Key) -> MemoryConfig:
    """What the memory model is to size for candidate ``key``: its shape at the job's N microbatches of one
    sequence, its degrees (FSDP over the rest of the GPUs), its AC mode, on the cluster's device."""
    schedule, k, part, v, pp, tp, cp, dp, ac = key
    cost = None if part == "even" else UnitCost.from_model_args(flavor_shape(job.flavor))
    shape = JobShape(
        job.seq_len,
        k,
        part,
        cost,
        job.length_multiple,
        tp,
        microbatches=job.local_batch_size,
        stages_per_rank=v,
        whole=schedule in TORCH_SCHEDULES,
        cp=cp,
    )
    return MemoryConfig(job.flavor, shape, schedule, pp, dp_shard=dp, activation_checkpoint=ac, device=cluster.device)


def _sim_config(job: planner.Job, cluster: planner.Cluster, key: Key) -> SimConfig:
    """What the simulator is to time for candidate ``key`` (at a number of microbatches of its own): the
    transformer cost model plus the cluster's fixed cost per unit, the recomputation of its AC mode
    (torchtitan's selective checkpoints every 2nd layer), a pipeline rank's GPUs and links, the
    compute-only lists (the planner's setting)."""
    schedule, k, part, v, pp, tp, cp, dp, ac = key
    network = Network(
        cluster.intra_node,
        cluster.inter_node,
        cluster.gpus_per_node,
        gpus_per_rank=cluster.gpus // pp,
        tensor_parallel=tp,
        context_parallel=cp,
        flops_per_gpu=cluster.flops_per_gpu,
    )
    return SimConfig(
        schedule,
        pp,
        job.local_batch_size,
        k,
        stages_per_rank=v,
        cost="transformer",
        flavor=job.flavor,
        seq_len=job.seq_len,
        partition=part,
        length_multiple=job.length_multiple,
        recompute={"none": 0.0, "selective": 0.5, "full": 1.0}[ac],
        unit_overhead=cluster.unit_overhead_s,
        network=network,
        torch_lowering=False,
    )


def _simulated_microbatches(n: int, p: int) -> set[int]:
    """The microbatches a step is simulated at: N where N <= 4p, else 2p and 4p (extended to N from there)."""
    return {n} if n <= 4 * p else {2 * p, 4 * p}


def _key_of(config: MemoryConfig | SimConfig, cluster: planner.Cluster) -> Key:
    """The candidate a memory model configuration or a simulator input says it is, by its schedule, cut
    and degrees."""
    if isinstance(config, SimConfig):
        network, recompute = config.network, {0.0: "none", 0.5: "selective", 1.0: "full"}[config.recompute]
        tp, cp = network.tensor_parallel, network.context_parallel
        cut = (config.schedule, config.subsequences, config.partition, config.stages_per_rank)
        return cut + (config.pp, tp, cp, network.gpus_per_rank // (tp * cp), recompute)
    shape = config.shape
    dp = cluster.gpus // (config.pp * shape.tp * shape.cp)
    cut = (config.schedule, shape.num_subsequences, shape.partition, shape.stages_per_rank)
    return cut + (config.pp, shape.tp, shape.cp, dp, config.activation_checkpoint)


def _assert_simulated(configs: list[SimConfig], job: planner.Job, cluster: planner.Cluster, key: Key) -> None:
    """``configs``, the simulator's inputs for candidate ``key``, are the ones built here, at the microbatches
    the step is simulated at, each cutting the candidate's lengths."""
    lengths = cut_lengths(job, *key[:3], *key[5:7])
    assert {c.microbatches for c in configs} == _simulated_microbatches(job.local_batch_size, key[4]), key
    for config in configs:
        assert dataclasses.replace(config, microbatches=job.local_batch_size) == _sim_config(job, cluster, key), key
        assert subsequence_lengths(config) == lengths, key


INPUT_JOBS = [
    # (job, cluster, every how many brute-force candidates one is evaluated)
    (planner.Job("debugmodel", 2048, 16), planner.Cluster(16, 0.1, gpus_per_node=4), 1),
    (planner.Job("8B", 32768, 8, length_multiple=128), planner.Cluster(64, 40), 17),
]
"""N above 4p, at 2p and below; CP, TP, torch's schedules and every partition; a budget the search has
candidates both fit and miss under."""


@pytest.mark.parametrize("job,cluster,every", INPUT_JOBS, ids=["debugmodel", "8B"])
def test_the_memory_model_and_the_simulator_get_the_candidates_inputs(job, cluster, every):
    """:func:`planner.evaluate` of a grid of candidates hands the memory model and the simulator what this
    file builds from the candidate; so does the search, in every memory floor and estimate it asks for."""
    memory_configs, sim_configs = [], []
    predict_memory, memory_floor, simulate = memory_check.predict_memory, memory_check.memory_floor, measure.simulate

    def estimate(config):
        memory_configs.append(config)
        return predict_memory(config)

    def floor(config, *args, **kwargs):
        memory_configs.append(config)
        return memory_floor(config, *args, **kwargs)

    def simulated(config):
        sim_configs.append(config)
        return simulate(config)

    candidates = sorted(_brute_force(job, cluster))
    with (
        mock.patch.object(memory_check, "predict_memory", estimate),
        mock.patch.object(memory_check, "memory_floor", floor),
        mock.patch.object(measure, "simulate", simulated),
    ):
        for key in candidates[::every]:
            measure.simulated_step.cache_clear()  # a step simulated before would not reach the simulator
            memory_configs.clear(), sim_configs.clear()
            plan = _evaluate(job, cluster, key)
            schedule, k, part, v, pp, tp, cp, dp, ac = key
            lengths = cut_lengths(job, schedule, k, part, tp, cp)
            assert memory_configs == [memory_config(job, cluster, key)], key
            assert memory_configs[0].shape.lengths == lengths, key
            _assert_simulated(sim_configs, job, cluster, key)
            assert (plan.pp, plan.tp, plan.cp, plan.dp_shard, list(plan.lengths)) == (pp, tp, cp, dp, lengths), key
        # The search's floors, estimates and simulations: each of a candidate, built as above.
        measure.simulated_step.cache_clear()
        memory_configs.clear(), sim_configs.clear()
        planner.plan(job, cluster, top=10, processes=1)
    assert memory_configs and sim_configs
    every_key = set(candidates)
    for config in memory_configs:
        key = _key_of(config, cluster)
        assert key in every_key and config == memory_config(job, cluster, key), key
    simulated_keys = {_key_of(config, cluster) for config in sim_configs}
    assert len(simulated_keys - every_key) == 0, sorted(simulated_keys - every_key)[:5]
    for key in simulated_keys:
        _assert_simulated([c for c in sim_configs if _key_of(c, cluster) == key], job, cluster, key)
