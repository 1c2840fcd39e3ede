"""The planner's search against an exhaustive evaluation of every candidate.

The search (:func:`torchtitan_seq.plan.plan`) visits candidates best bound first, drops most by the
memory model's floor, stops once no bound can enter the table, and leaves out a fitting plan's
heavier twins (same schedule choice and p, no less TP, CP and recomputation). Its answer must be
the table those rules define, which this file builds the slow way: every schedule choice on every
mesh and AC mode that can cut the sequence and run, each evaluated in full
(:func:`~torchtitan_seq.plan.evaluate`: the simulated step and the memory model's estimate), the
fitting ones without a fitting lighter twin, fastest first.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from torchtitan_seq import plan as planner
from torchtitan_seq.plan.measure import schedule_runs
from torchtitan_seq.plan.twins import no_heavier

TOL = 1e-9
"""The tokens/s of a row: the search and the evaluation compute them with the same functions."""


def _exhaustive(job: planner.Job, cluster: planner.Cluster) -> list[planner.Plan]:
    """Every candidate that can cut the sequence and run, evaluated: no bound, no stop, no pruning."""
    args = planner.flavor_shape(job.flavor)
    rows = []
    for choice, (pp, tp, cp, _) in itertools.product(planner.CHOICES, planner.candidate_meshes(job, cluster, args)):
        if planner.cut_lengths(job, choice, tp, cp) is None or not schedule_runs(
            choice, pp, job.local_batch_size, args.n_layers
        ):
            continue
        rows += [planner.evaluate(job, cluster, choice, pp, tp, ac, cp) for ac in planner.AC_MODES]
    return rows


def _degrees(p: planner.Plan) -> tuple[int, int, int]:
    return p.tp, p.cp, planner.AC_MODES.index(p.activation_checkpoint)


def _twin_key(p: planner.Plan) -> tuple:
    return p.schedule, p.num_subsequences, p.partition, p.stages_per_rank, p.pp


def plan_table(rows: list[planner.Plan]) -> list[planner.Plan]:
    """The fitting rows that have no fitting lighter twin, fastest first."""
    fitting = [p for p in rows if p.fits]
    kept = [
        p
        for p in fitting
        if not any(
            q is not p and _twin_key(q) == _twin_key(p) and no_heavier(_degrees(q), _degrees(p)) for q in fitting
        )
    ]
    return sorted(kept, key=lambda p: -p.tokens_per_s)


def _row(p: planner.Plan) -> tuple:
    return (*_twin_key(p), *_degrees(p), p.dp_shard, p.lengths)


def _assert_same_rows(got: list[planner.Plan], want: list[planner.Plan], table: list[planner.Plan]) -> None:
    """``got`` has ``want``'s tokens/s row by row, and each of its rows is a row of ``table`` at that speed
    (rows of equal tokens/s may come in either order)."""
    assert len(got) == len(want), ([_row(p) for p in got], [_row(p) for p in want])
    for g, w in zip(got, want):
        assert abs(g.tokens_per_s - w.tokens_per_s) <= TOL * w.tokens_per_s, (_row(g), _row(w))
        tied = {
            _row(p): p.peak_memory_gib for p in table if abs(p.tokens_per_s - g.tokens_per_s) <= TOL * g.tokens_per_s
        }
        assert _row(g) in tied and abs(tied[_row(g)] - g.peak_memory_gib) <= TOL * g.peak_memory_gib, (_row(g), tied)
    assert len({_row(g) for g in got}) == len(got)


def assert_top_plans(
    job: planner.Job, cluster: planner.Cluster, every: list[planner.Plan], budgets: tuple[float, ...], wider: bool
) -> None:
    """At each memory budget, for N in 1, 3, 10: the planner's top N on ``cluster`` are the first N rows of
    the table of ``every`` evaluated candidate (or it says nothing fits); ``wider``: and the first N of its
    top 3N are its top N."""
    for budget in budgets:
        at_budget = dataclasses.replace(cluster, gpu_memory_gib=budget)
        table = plan_table([dataclasses.replace(p, fits=p.peak_memory_gib <= budget) for p in every])
        for top in (1, 3, 10):
            if not table:
                with pytest.raises(ValueError, match="nothing fits"):
                    planner.plan(job, at_budget, top=top, processes=1)
                continue
            got = [p for p in planner.plan(job, at_budget, top=top, processes=1) if p.fits]
            _assert_same_rows(got, table[:top], table)
            if wider:
                more = [p for p in planner.plan(job, at_budget, top=3 * top, processes=1) if p.fits]
                _assert_same_rows(more[:top], got, table)


JOBS = [("debugmodel", 2048, 4, 8), ("debugmodel", 4096, 8, 4)]
"""(flavor, seq_len, GPUs, local batch): small shapes, every candidate evaluated in about a second."""


@pytest.mark.parametrize("flavor,seq_len,gpus,batch", JOBS)
@pytest.mark.parametrize("overhead", [0.0, planner.H200_UNIT_OVERHEAD_S], ids=["flops", "h200"])
def test_top_n_is_the_first_n_rows_of_the_exhaustive_table(flavor, seq_len, gpus, batch, overhead):
    """For N in 1, 3, 10 and budgets loose (all fit), tight (the median peak) and too small (none fits)."""
    job = planner.Job(flavor, seq_len, batch)
    # Evaluated once: a row's tokens/s and peak do not depend on the budget, only whether it fits.
    every = _exhaustive(job, planner.Cluster(gpus, 1e6, unit_overhead_s=overhead))
    peaks = sorted(p.peak_memory_gib for p in every)
    budgets = (max(peaks) * 2, peaks[len(peaks) // 2], peaks[0] * 0.99)
    cluster = planner.Cluster(gpus, 1e6, unit_overhead_s=overhead)
    assert_top_plans(job, cluster, every, budgets, wider=True)
