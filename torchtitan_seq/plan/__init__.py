"""Choosing a configuration: the best schedule and settings for a model, a cluster and a memory budget.

The command is :mod:`.cli` (``python -m torchtitan_seq.plan --help``).

The search covers the pipeline, tensor-, context- and data-parallel (FSDP) degrees, the
schedule (torch's and the sequence schedules), k, the partition and the
activation checkpointing mode (:data:`CHOICES` on every split of the GPUs); the
stages per rank are each schedule's own, not searched. Every configuration is cut
as the runtime cuts it (:class:`~torchtitan_seq.runtime.shape.JobShape`, ``--length-multiple``),
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
  it fits). CP (:mod:`torchtitan_seq.runtime.context_parallel`) splits each unit's
  compute over c GPUs of the same replica and adds K/V collectives, while data
  parallelism over them would run other sequences: a CP plan only enters the table
  where its twin without CP does not fit (long sequences, tight memory);
- a sequence schedule that fits only with the K/V context offloaded to host memory
  (``kv_offload``, :mod:`torchtitan_seq.runtime.kv_offload`) is proposed with it where ``--kv-offload``
  allows: its floor and need are those with offload, and its step is simulated with the copies on each
  rank's host link (``--host-link-gbps``, :mod:`torchtitan_seq.simulate.offload`);
- an MLA model's sequence schedule that fits only keeping MLA's latent (``kv_context = "latent"``) is
  proposed with it unless ``--no-latent``: its need is the memory model's with the latent, and its step
  priced with the prefix expansion's FLOPs (:func:`~torchtitan_seq.plan.flops.latent_flops`);
- a step is simulated at N' = min(N, 2p) and 2N' microbatches and extended
  linearly to N (at N alone where N <= 4p): past the warm-up each further
  microbatch adds the same time (within 1%, tested), on the compute-only lists (``torch_lowering=False``:
  the same timeline, without torch's lowering passes); lists, their
  preparation for timing and the memory model's walks are built once per
  shape and reused across TP, AC and cost choices;
- with more than one CPU, the search runs in up to 4 processes (``--processes``): forked helpers
  visit the candidates of their share of schedule shapes ahead of the search, which takes their
  answers (:mod:`torchtitan_seq.plan.lookahead`): the same plans, in less time.

Unit times are the transformer cost model (:class:`~torchtitan_seq.runtime.partition.UnitCost`)
at ``--tflops`` achieved per GPU, plus a fixed cost per unit and layer
(``--unit-overhead-ms``, by default :data:`H200_UNIT_OVERHEAD_S`, measured): what
a unit costs beyond its share of the FLOPs, which makes many short units slower
than few long ones. With ``--cost``, calibration files
(``benchmarks/bench.py --calibrate``) replace both: a configuration whose pp and
sequence cut were measured uses those unit times, the others the model at the
FLOP/s the files achieved plus the fixed cost fitted to them
(:func:`~torchtitan_seq.simulate.costs.fit_cost_files`). ``benchmarks/planner_check.py`` sets the planner's
ranking and peaks beside a measured benchmark.

The package, one concept a module: :mod:`.choices` (what the search tries), :mod:`.job` (the job
and the cluster), :mod:`.record` (a plan and its settings), :mod:`.flops` and :mod:`.costs` (what
a step costs), :mod:`.bounds` (the candidates and their bounds), :mod:`.memory_check` (whether one
fits), :mod:`.measure` (its simulated step), :mod:`.twins` (twin pruning), :mod:`.shares` (the
search in several processes), :mod:`.search` (the search) and :mod:`.cli` (the command).
"""

from __future__ import annotations

import gc
import sys

if sys.argv[0] == "-m":
    # Being found by ``python -m torchtitan_seq.plan`` (runpy sets argv[0] to "-m" while it imports the
    # package, then to __main__'s path): run as the command, the cyclic collector is off from here to the
    # exit. Importing torch and torch.distributed.pipelining (below) makes hundreds of thousands of
    # objects, and the collections they set off walk them again and again, a large share of the import.
    # The search makes millions of small acyclic objects (see search.without_cycle_collection), and a
    # collector turned back on would walk what it cached once more just before the process ends.
    # Imported as a module, nothing changes.
    gc.disable()

# Beside __all__, the submodules' names that the tests and the benchmarks reach as
# torchtitan_seq.plan.<name>.
from torchtitan_seq.plan.bounds import Candidate, candidate_meshes, candidates_of, cut_lengths  # noqa: F401
from torchtitan_seq.plan.choices import (  # noqa: F401
    AC_MODES,
    CHOICES,
    CP_DEGREES,
    RECOMPUTE,
    TP_DEGREES,
    ScheduleChoice,
    schedule_choices,
)
from torchtitan_seq.plan.cli import main, plan_table  # noqa: F401
from torchtitan_seq.plan.costs import Costs, step_network, tp_seconds  # noqa: F401
from torchtitan_seq.plan.flops import fill_flops, path_flops, stage_layers, step_flops, unit_flops  # noqa: F401
from torchtitan_seq.plan.job import H200_UNIT_OVERHEAD_S, Cluster, Job  # noqa: F401
from torchtitan_seq.plan.measure import Step, evaluate, measure_candidate, plan_of, schedule_runs, simulated_step  # noqa: F401
from torchtitan_seq.plan.memory_check import Group, MemoryCheck, Miss, memory, memory_config  # noqa: F401
from torchtitan_seq.plan.record import Plan  # noqa: F401
from torchtitan_seq.plan.search import plan, search_plans, without_cycle_collection  # noqa: F401
from torchtitan_seq.plan.shares import answers_ahead, shares  # noqa: F401
from torchtitan_seq.plan.twins import Kept, no_heavier  # noqa: F401
from torchtitan_seq.runtime.partition import UnitCost  # noqa: F401
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES  # noqa: F401
from torchtitan_seq.simulate.flavors import flavor_shape  # noqa: F401
from torchtitan_seq.simulate.memory import gib  # noqa: F401

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
