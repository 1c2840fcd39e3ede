"""K/V offload in the tools: the simulator's host link (copies that outlast the passes they overlap delay the
rank), the planner's memory check (offload only where a configuration fits only with it) and its plans
(``--sequence_pipeline.kv_offload`` in the overrides, the TOML and the 0.3 config function)."""

from __future__ import annotations

import itertools
import math

import pytest
from test_planner_exhaustive import plan_table

from torchtitan_seq import plan as planner
from torchtitan_seq.plan import search
from torchtitan_seq.plan.bounds import Candidate
from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.plan.cli import main
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.measure import schedule_runs
from torchtitan_seq.plan.memory_check import KVOption, MemoryCheck, memory_config
from torchtitan_seq.plan.search import plan
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.engine import simulate
from torchtitan_seq.simulate.memory import gib, predict_memory
from torchtitan_seq.simulate.offload import offload_delays

# InterleavedSeq1F1B on 4 ranks holds more microbatches than it runs at once: its arenas lie unread for a while.
# On 8 GPUs (FSDP over 2) with full AC it needs the least of its pipeline degrees, with offload less still.
CHOICE = ScheduleChoice("InterleavedSeq1F1B", 4, "compute", 2)
JOB = Job("70B", 65536, 16, tp=1, cp=1, kv_offload=True)
PP, GPUS = 4, 8


def _need(offload: bool) -> float:
    option = KVOption(JOB.kv_context, offload)
    return gib(predict_memory(memory_config(JOB, Cluster(GPUS, 80), CHOICE, PP, 1, "full", 1, option)).total)


@pytest.mark.parametrize(
    "schedule,p,n,k,v", [("Seq1F1B", 4, 8, 4, None), ("InterleavedSeq1F1B", 2, 4, 4, 2), ("BSIPipe", 2, 4, 4, None)]
)
def test_copies_delay_a_rank_only_where_the_link_is_slower_than_the_passes(schedule, p, n, k, v):
    result = simulate(SimConfig(schedule, p, n, k, stages_per_rank=v, seq_len=64))
    assert offload_delays(result, 0.0) == [0.0] * p  # a free link: the copies overlap compute
    slow, slower = offload_delays(result, 0.05), offload_delays(result, 0.5)
    assert max(slow) > 0 and all(b >= a for a, b in zip(slow, slower))
    assert offload_delays(simulate(SimConfig(schedule, p, n, 1, stages_per_rank=v, seq_len=64)), 0.5) == [0.0] * p


def test_offload_lowers_the_need_of_a_schedule_whose_arenas_lie_unread():
    assert _need(True) < _need(False)


def test_the_memory_check_offloads_only_what_fits_only_with_it():
    low, high = _need(True), _need(False)
    c = Candidate(CHOICE, PP, 1, GPUS // PP, "full", math.inf, 1)
    for budget, job, need, offloads in [
        (high + 1, JOB, high, False),  # fits without: no offload
        ((low + high) / 2, JOB, low, True),  # fits only with it
        ((low + high) / 2, Job("70B", 65536, 16, tp=1, cp=1, kv_offload=False), None, False),
        (low - 1, JOB, None, False),
    ]:
        check = MemoryCheck(job, Cluster(GPUS, budget), {PP: [(1, 1, GPUS // PP)]})
        assert check.need(c) == (pytest.approx(need) if need is not None else None)
        assert check.option(c).offload == offloads


def test_the_planner_proposes_offload_where_a_configuration_fits_only_with_it(monkeypatch, capsys):
    monkeypatch.setattr(search, "CHOICES", [CHOICE])
    low, high = _need(True), _need(False)
    offloaded = plan(JOB, Cluster(GPUS, (low + high) / 2), top=1, processes=1)[0]
    plain = plan(JOB, Cluster(GPUS, high + 1), top=1, processes=1)[0]
    assert offloaded.fits and offloaded.kv_offload and offloaded.pp == PP and not plain.kv_offload
    assert offloaded.tokens_per_s <= plain.tokens_per_s  # the copies may delay, never speed up, a step
    overrides = offloaded.overrides(JOB.flavor, JOB.seq_len, JOB.local_batch_size)
    assert "--sequence_pipeline.kv_offload" in overrides.split(" ")
    assert "kv_offload = true" in offloaded.toml(JOB.flavor, JOB.seq_len, JOB.local_batch_size)
    assert "config.sequence_pipeline.kv_offload = True" in offloaded.config_function(
        JOB.flavor, JOB.seq_len, JOB.local_batch_size
    )
    args = [
        "--flavor",
        "70B",
        "--seq-len",
        "65536",
        "--gpus",
        "8",
        "--local-batch-size",
        "16",
        "--tp",
        "1",
        "--cp",
        "1",
    ]
    args += ["--gpu-memory-gib", f"{(low + high) / 2}", "--top", "1", "--processes", "1"]
    assert main([*args, "--kv-offload"]) == 0
    assert "InterleavedSeq1F1B +kv_offload" in capsys.readouterr().out
    assert main(args) == 2  # not asked to: nothing fits
    assert "nothing fits" in capsys.readouterr().err


JOBS = [("debugmodel", 8192, 8, 8)]
"""(flavor, seq_len, GPUs, local batch): long enough for the K/V context to matter, every candidate evaluated
in seconds."""


def _every(job: Job, cluster: Cluster) -> list:
    """Every candidate the planner generates that cuts and runs, evaluated at ``cluster``'s budget."""
    args = planner.flavor_shape(job.flavor)
    rows = []
    for choice, (pp, tp, cp, _) in itertools.product(planner.CHOICES, planner.candidate_meshes(job, cluster, args)):
        if planner.cut_lengths(job, choice, tp, cp) is not None and schedule_runs(
            choice, pp, job.local_batch_size, args.n_layers
        ):
            rows += [planner.evaluate(job, cluster, choice, pp, tp, ac, cp) for ac in planner.AC_MODES]
    return rows


def _key(p) -> tuple:
    return p.schedule, p.num_subsequences, p.partition, p.pp, p.tp, p.cp, p.activation_checkpoint


@pytest.mark.parametrize("flavor,seq_len,gpus,batch", JOBS)
def test_with_offload_the_top_plans_are_the_first_rows_of_the_exhaustive_table(flavor, seq_len, gpus, batch):
    """As test_planner_exhaustive.py's table, each candidate evaluated at each budget (:func:`planner.evaluate`
    offloads only what fits only so): the planner's top plans are its first rows, some with offload."""
    job = Job(flavor, seq_len, batch, kv_offload=True)
    plain = {_key(p): p.peak_memory_gib for p in _every(job, Cluster(gpus, 1e9))}
    # Budgets at which a configuration fits only with offload: its need with it, the smallest few.
    least = _every(job, Cluster(gpus, 0.0))  # nothing fits: each need with offload where allowed
    budgets = sorted({p.peak_memory_gib for p in least if p.kv_offload and p.peak_memory_gib < plain[_key(p)]})
    assert budgets
    offloaded = 0
    for budget in [*budgets[:4], min(plain.values())]:
        table = plan_table(_every(job, Cluster(gpus, budget)))
        offloaded += sum(p.kv_offload for p in table[:3])
        for top in (1, 3):
            got = [p for p in plan(job, Cluster(gpus, budget), top=top, processes=1) if p.fits]
            assert [(p.tokens_per_s, p.kv_offload) for p in got] == [
                (pytest.approx(p.tokens_per_s, rel=1e-9), p.kv_offload) for p in table[:top]
            ], budget
    assert offloaded > 0
