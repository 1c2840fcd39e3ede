"""The search: every candidate, best bound first, measured where it runs and fits, until the next bound
cannot enter the table (the package's docstring says how it stays fast)."""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator

from torchtitan_seq.plan.bounds import candidate_meshes, candidates_of
from torchtitan_seq.plan.choices import CHOICES, ScheduleChoice
from torchtitan_seq.plan.costs import Costs
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.lookahead import Lookahead, available_processes
from torchtitan_seq.plan.measure import measure_candidate, plan_of, schedule_runs
from torchtitan_seq.plan.memory_check import MemoryCheck, kv_options
from torchtitan_seq.plan.record import Plan
from torchtitan_seq.plan.shares import answers_ahead, shares
from torchtitan_seq.plan.twins import Kept, no_heavier
from torchtitan_seq.runtime.partition import UnitCost
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.titan.flavors import flavor_shapes


@contextlib.contextmanager
def without_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (restored as it was on leaving). The
    search makes millions of small acyclic objects (actions, steps, tuples), which reference counting
    frees; each of the collections they would set off walks every live object, torch's own included,
    to free none of the search's."""
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

    Args:
        job: what is trained.
        cluster: the GPUs it may use.
        top: how many configurations that fit to return at most.
        processes: how many processes the search runs in at most (:mod:`~torchtitan_seq.plan.lookahead`;
            the same plans in any number), and no more than one per CPU; None: 4.

    Returns:
        The plans, fastest first; those that do not fit (``fits`` False) last.

    Raises:
        ValueError: naming the setting, for an unknown flavor, GPU counts no degrees divide, or a
            memory budget nothing fits.
    """
    if processes is not None and processes < 1:
        raise ValueError(f"--processes {processes}: at least 1")
    with without_cycle_collection():
        return search_plans(job, cluster, top, min(processes or 4, available_processes()))


def search_plans(job: Job, cluster: Cluster, top: int, processes: int) -> list[Plan]:
    """:func:`plan`'s search (see the package's docstring)."""
    if (args := flavor_shape(job.flavor)) is None:
        raise ValueError(f"--flavor {job.flavor!r} does not exist: use one of {sorted(flavor_shapes)}")
    if min(job.seq_len - 1, job.local_batch_size, job.length_multiple, cluster.gpu_memory_gib) <= 0:
        raise ValueError(
            "--seq-len, --local-batch-size, --length-multiple and --gpu-memory-gib must be positive "
            "(seq-len at least 2)"
        )
    costs = Costs.load(job, cluster, args)
    cost = UnitCost.from_model_args(args)
    by_pp: dict[int, list[tuple[int, int, int]]] = {}
    for pp, tp, cp, dp in candidate_meshes(job, cluster, args):
        by_pp.setdefault(pp, []).append((tp, cp, dp))
    candidates = [c for choice in CHOICES for c in candidates_of(choice, by_pp, job, cluster, costs, args, cost)]
    # Best bound first. A configuration is slower than one with no more TP, no more CP and no more
    # recomputation (its bound is lower, so that one mostly comes first): once one fits, the
    # heavier ones of its schedule and pp are skipped, or dropped where a near tie of bounds
    # visited one first. Memory is only asked of what is visited.
    candidates.sort(key=lambda c: -c.bound)
    fitting: list[tuple[Plan, tuple[ScheduleChoice, int], tuple[int, int, int]]] = []
    kept = Kept()
    check = MemoryCheck(job, cluster, by_pp)

    def visit(i: int) -> Plan | None:
        """Candidate i measured where it runs and fits, else None."""
        c = candidates[i]
        if not schedule_runs(c.choice, c.pp, job.local_batch_size, args.n_layers) or (need := check.need(c)) is None:
            return None
        return measure_candidate(c, job, cluster, costs, args, need, True, check.option(c))

    with Lookahead.start(shares(candidates, processes), answers_ahead(candidates, visit), processes) as ahead:
        for i, c in enumerate(candidates):
            if len(fitting) >= top and c.bound < fitting[top - 1][0].tokens_per_s:
                break
            if kept.skips(c) or (measured := ahead.answer(i, visit)) is None:
                continue
            key, degrees = kept.keep(c)
            fitting = [f for f in fitting if f[1] != key or not no_heavier(degrees, f[2])]  # no heavier twin
            fitting.append((measured, key, degrees))
            fitting.sort(key=lambda f: -f[0].tokens_per_s)
    if ahead.forked and len(fitting) < top:
        # The rows that do not fit come from the misses met in the order of one process.
        return search_plans(job, cluster, top, processes=1)
    closest = check.closest() if len(fitting) < top else []
    if not fitting:
        need, c = closest[0]
        raise ValueError(
            f"--gpu-memory-gib {cluster.gpu_memory_gib:g}: nothing fits; the smallest configuration "
            f"({c.choice.schedule}, pp {c.pp}, tp {c.tp}{f', cp {c.cp}' if c.cp > 1 else ''}, "
            f"k {c.choice.num_subsequences}, activation "
            f"checkpointing {c.ac}) needs {need:.1f} GiB per GPU"
        )
    over = [
        plan_of(c, job, math.nan, need, math.nan, False, kv_options(job, c.choice, c.cp)[-1]) for need, c in closest
    ]
    return [plan for plan, _, _ in fitting[:top]] + over
