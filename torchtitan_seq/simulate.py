"""Timing simulation of pipeline schedules, on the action lists the runtime executes.

What is simulated
-----------------
A schedule is first written as compute-only per-rank lists (F, B, I, W and
DualPipeV's OVERLAP_F_B): for a sequence schedule of
:data:`torchtitan_seq.schedules.SEQUENCE_SCHEDULES` by its ``actions_fn`` and
checked with :func:`~torchtitan_seq.ordering.validate_unit_order`; for one of
torch's (``1F1B``, ``Interleaved1F1B``, ``GPipe``, ``LoopedBFS``,
``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) by instantiating
torch's class on mock stages and reading its ``pipeline_order`` (1F1B and
GPipe run their own loop: their IR is renumbered the way that loop counts
microbatches, see ``_executed_order``). The lists are
then lowered exactly as ``_PipelineScheduleRuntime._prepare_schedule_with_comms``
does (torch's ``_validate_schedule`` infers the stage -> rank placement, then
``_add_unshard_reshard``, ``_add_reduce_grad``, ``_add_send_recv``), and the
lowered lists are what runs here. Units are numbered ``m * k + j``
(microbatch m, subsequence j); torch's schedules have k = 1.

Timing model
------------
Each rank executes its list in order, one action at a time, like the runtime's
loop. A compute action starts when the rank is free and its inputs exist:

- F of stage s needs the output of stage s - 1 (the forward on the same rank,
  or the matching SEND_F on the rank that holds s - 1, plus ``comm_latency``);
- B or I of stage s needs its own F and the input gradient of stage s + 1
  (B/I on the same rank, or the matching SEND_B plus ``comm_latency``);
- W needs its I.

SEND is issued when the rank reaches it (right after the compute it sends);
RECV only posts a receive, as torch's ``irecv``: the runtime waits for the data
at the compute that consumes it, and so does this model. UNSHARD, RESHARD and
REDUCE_GRAD take no time. An OVERLAP_F_B runs its sub-actions one after the
other, its SENDs after the last one, as the runtime does without a custom
overlap function. When no rank can progress the simulation stops and reports
where each rank is stuck (:class:`Deadlock`) instead of hanging; a list that
torch's ``_add_send_recv`` cannot lower (it deadlocks in lowering already) is
run with a SEND after every compute that feeds another rank, to say where.

Costs and units of measure
--------------------------
Time is measured in forwards of one whole microbatch on a stage holding 1/p of
the layers. Unit j of length L_j after a prefix P_j, on a stage holding 1/V of
a rank's layers (V stages per rank), costs:

- ``uniform``: F = L_j / S / V, B = 2 F, I = W = F (S the sequence length);
- ``transformer``: :class:`~torchtitan_seq.partition.UnitCost` of the model
  flavor: F = forward(L_j, P_j), I = backward_input, W = backward_weight,
  B = I + W, divided by forward(S, 0) and by V;
- a JSON file of measured times of one unit on a stage with 1/p of the layers
  (divided by V here), one entry per subsequence j::

      {"F": [t_0, ..., t_{k-1}], "B": [...], "I": [...], "W": [...]}

  ``F`` is required, and ``B`` or both ``I`` and ``W``; ``B`` defaults to
  I + W; ``I`` and ``W`` are needed only by schedules that split backward.
  Other keys (metadata) are ignored. Times are in any one unit (seconds, ms).

Activations are counted in M, one whole microbatch's activations on 1/p of the
layers: unit j on a stage with 1/V of the rank's layers weighs (L_j / S) / V,
alive from its F until its backward finishes (B, or W where backward is split:
W still needs the saved inputs).

Usage::

    python -m torchtitan_seq.simulate --schedule Seq1F1B --pp 4 --microbatches 4 \\
        --subsequences 4 --svg seq1f1b.svg --json
    python -m torchtitan_seq.simulate --regenerate schedules

The command exits with 1 on a deadlock and 2 on a schedule or shape it
rejects (an ordering violation, an unsupported N, an unknown name).
"""

from __future__ import annotations

import argparse
import colorsys
import csv
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from xml.sax.saxutils import escape

from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_reduce_grad,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _validate_schedule,
    get_schedule_class,
    PipelineScheduleSingle,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from .bidirectional import BidirectionalLayout, lower_chains
from .ordering import B, F, I, W, validate_unit_order
from .partition import PARTITIONS, UnitCost, partition_sequence
from .schedules import SEQUENCE_SCHEDULES

__all__ = [
    "TORCH_SCHEDULES",
    "SimConfig",
    "UnitTimes",
    "Deadlock",
    "SimResult",
    "simulate",
    "simulate_order",
    "unit_times",
    "render_svg",
    "chrome_trace",
    "compute_csv",
    "regenerate",
]

SEND_F = _ComputationType.SEND_F
SEND_B = _ComputationType.SEND_B
OVERLAP_F_B = _ComputationType.OVERLAP_F_B

ActionLists = dict[int, list[_Action | None]]
Interval = tuple[float, float, _Action]

# torch's schedules this module can build; the V-shaped ones place two stages
# per rank as torchtitan does (generate_stage_to_rank_mapping style "v").
TORCH_SCHEDULES = (
    "1F1B",
    "Interleaved1F1B",
    "GPipe",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_TORCH_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class SimConfig:
    """One schedule shape to simulate."""

    schedule: str
    """A name in SEQUENCE_SCHEDULES or TORCH_SCHEDULES."""
    pp: int
    """p, ranks in the pipeline."""
    microbatches: int
    """N, microbatches per step."""
    subsequences: int = 1
    """k, subsequences per microbatch; 1 for torch's schedules."""
    stages_per_rank: int | None = None
    """V; None takes the schedule's own (class attribute ``stages_per_rank``,
    1 for a sequence schedule without it, 2 for torch's multi-stage ones)."""
    split_backward: bool = False
    """Sequence schedules only: I and W passes instead of B."""
    cost: str = "uniform"
    """'uniform', 'transformer', or the path of a JSON file of measured times."""
    flavor: str = "debugmodel"
    """Model flavor for the 'transformer' cost and the 'compute' partition."""
    seq_len: int = 2048
    """S, tokens per sequence."""
    partition: str = "even"
    """How sequences are cut: 'even' or 'compute' (torchtitan_seq.partition)."""
    comm_latency: float = 0.0
    """Time from a SEND to the data being usable on the receiving rank."""


@dataclass(frozen=True)
class UnitTimes:
    """Time of each pass of unit j on a stage holding 1/p of the layers.

    Each field is indexed by subsequence j. ``I`` and ``W`` are None when
    unknown (a cost file without them); schedules that split backward need them.
    """

    F: tuple[float, ...]
    B: tuple[float, ...]
    I: tuple[float, ...] | None = None  # noqa: E741
    W: tuple[float, ...] | None = None


@dataclass(frozen=True)
class StuckRank:
    """Where one rank stopped: the action at ``index`` of its list (see :class:`Deadlock`)."""

    rank: int
    index: int
    action: str
    waits_for: str


@dataclass(frozen=True)
class Deadlock:
    """No rank could progress.

    ``list_kind`` is "lowered" (indices into the lowered lists the runtime
    runs) or "compute-only" (torch's lowering rejected the lists; indices
    into the compute-only lists).
    """

    list_kind: str
    stuck: tuple[StuckRank, ...]

    def describe(self) -> str:
        where = "; ".join(
            f"rank {s.rank} stuck at action {s.index} ({s.action}) waiting for {s.waits_for}"
            for s in self.stuck
        )
        return f"no rank can progress ({self.list_kind} lists): {where}"


@dataclass
class SimResult:
    """Outcome of one simulation; :meth:`summary` is what ``--json`` prints."""

    schedule: str
    pp: int
    microbatches: int
    subsequences: int
    stages_per_rank: int
    split_backward: bool
    cost: str
    lengths: list[int]
    bubble_ratio: float
    """Idle time over makespan, averaged over ranks."""
    makespan: float
    peak_activations: list[float]
    """Per rank, in M (see the module docstring)."""
    parameter_copies: int
    deadlock: Deadlock | None
    timeline: dict[int, list[Interval]]
    """Per rank, (start, end, action) of every compute action, in run order."""
    compute_order: ActionLists = field(repr=False)
    """The compute-only lists (None: an idle slot of torch's own format)."""
    lowered: dict[int, list[_Action]] = field(repr=False)

    def summary(self) -> dict:
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "subsequences": self.subsequences,
            "stages_per_rank": self.stages_per_rank,
            "split_backward": self.split_backward,
            "cost": self.cost,
            "lengths": self.lengths,
            "bubble_ratio": self.bubble_ratio,
            "makespan": self.makespan,
            "peak_activations": self.peak_activations,
            "parameter_copies": self.parameter_copies,
            "deadlock": self.deadlock.describe() if self.deadlock else False,
        }


class _MockStage(_PipelineStageBase):
    """A stage without module or process group, enough for torch's schedule
    constructors (the trick of torch's test_schedule.py MockPipelineStage)."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        self.submod = None
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.group = None

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, *args, **kwargs):
        pass

    def _prepare_backward_infra(self, *args, **kwargs):
        pass


# --------------------------------------------------------------------------
# Building and lowering the action lists


@dataclass(frozen=True)
class _Built:
    order: ActionLists
    stages_per_rank: int
    placement: str
    parameter_copies: int


def _build(config: SimConfig) -> _Built:
    """Compute-only lists of ``config``'s schedule, checked against its placement."""
    p, n, k = config.pp, config.microbatches, config.subsequences
    if config.schedule in SEQUENCE_SCHEDULES:
        cls = SEQUENCE_SCHEDULES[config.schedule]
        v = config.stages_per_rank or cls.stages_per_rank
        placement = cls.stage_placement
        order = cls.compute_order(p, n, k, split_backward=config.split_backward, stages_per_rank=v)
        validate_unit_order(order, k)
    elif config.schedule in TORCH_SCHEDULES:
        if k != 1 or config.split_backward:
            raise ValueError(
                f"{config.schedule} is torch's schedule: it runs whole microbatches "
                "(subsequences 1) and picks its own backward split"
            )
        cls = get_schedule_class(config.schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        v = config.stages_per_rank or (1 if single else 2)
        if (single and v != 1) or (not single and v < 2):
            raise ValueError(
                f"{config.schedule} runs {'one stage' if single else 'at least 2 stages'} per "
                f"rank, not {v}"
            )
        placement = "v" if config.schedule in _TORCH_V_SCHEDULES else "loop"
        mapping = generate_stage_to_rank_mapping(p, p * v, style=placement)
        stages = [_MockStage(s, p * v, p) for s, r in mapping.items() if r == 0]
        sched = cls(stages[0] if single else stages, n)
        order = _executed_order(sched.pipeline_order) if single else sched.pipeline_order
    else:
        raise ValueError(
            f"unknown schedule {config.schedule!r}: use one of "
            f"{sorted(SEQUENCE_SCHEDULES) + list(TORCH_SCHEDULES)}"
        )
    return _Built(order, v, placement, getattr(cls, "parameter_copies", 1))


def _executed_order(ir: ActionLists) -> ActionLists:
    """What a single-stage torch schedule executes, from its ``_get_pipeline_order``.

    Its own ``_step_microbatches`` runs forwards and backwards each in
    microbatch order, by counters; the IR gives the interleaving, but in torch
    2.13 1F1B's IR numbers the last rank's forwards from 1 (1..N), so the
    microbatches are renumbered by those counters. REDUCE_GRAD is dropped: the
    compute-only format (and its CSV loader) holds compute actions only.
    """
    order: ActionLists = {}
    for rank, actions in ir.items():
        count = {F: 0, B: 0}
        order[rank] = []
        for a in actions:
            if a is not None and not a.is_compute_op:
                continue
            if a is not None:
                a = _Action(a.stage_index, a.computation_type, count[a.computation_type])
                count[a.computation_type] += 1
            order[rank].append(a)
    return order


def _lower(
    order: ActionLists, num_stages: int, num_units: int, chain_length: int
) -> tuple[dict[int, list[_Action]] | None, dict[int, int]]:
    """torch's lowering, as ``_prepare_schedule_with_comms`` runs it; for
    stages in several chains (BSIPipe), the schedule's own
    (:func:`~torchtitan_seq.bidirectional.lower_chains`).

    Returns (lowered lists, stage -> rank); the lists are None when no order
    for the sends and receives exists (a deadlock).
    """
    if chain_length != num_stages:
        stage_to_rank = {a.stage_index: r for r, acts in order.items() for a in acts if a is not None}
        try:
            units_per_stage = num_units * chain_length // num_stages
            return lower_chains(order, stage_to_rank, chain_length, units_per_stage), stage_to_rank
        except ValueError:
            return None, stage_to_rank
    stage_to_rank = _validate_schedule(order, len(order), num_stages, num_units)
    with_fsdp = {r: _add_reduce_grad(_add_unshard_reshard(acts), num_units) for r, acts in order.items()}
    try:
        return _add_send_recv(with_fsdp, stage_to_rank.__getitem__, num_stages), stage_to_rank
    except AssertionError as e:
        if "can't schedule sends/recvs" not in str(e):
            raise
        return None, stage_to_rank


def _compute_leaves(action: _Action) -> tuple[_Action, ...]:
    return action.sub_actions if action.computation_type == OVERLAP_F_B else (action,)


def _send_after_compute(
    order: ActionLists, stage_to_rank: dict[int, int], chain_length: int
) -> dict[int, list[tuple[int, _Action]]]:
    """Compute-only lists with a SEND after each compute that feeds another rank;
    each entry keeps its compute's index so a deadlock points into ``order``."""
    out: dict[int, list[tuple[int, _Action]]] = {}
    for rank, actions in order.items():
        steps: list[tuple[int, _Action]] = []
        for i, a in enumerate(actions):
            if a is None:
                continue
            steps.append((i, a))
            for leaf in _compute_leaves(a):
                s, kind = leaf.stage_index, leaf.computation_type
                if kind == F and s % chain_length < chain_length - 1 and stage_to_rank[s + 1] != rank:
                    steps.append((i, _Action(s, SEND_F, leaf.microbatch_index)))
                elif kind in (B, I) and s % chain_length > 0 and stage_to_rank[s - 1] != rank:
                    steps.append((i, _Action(s, SEND_B, leaf.microbatch_index)))
        out[rank] = steps
    return out


# --------------------------------------------------------------------------
# Timing


def _needs(
    a: _Action, stage_to_rank: dict[int, int], chain_length: int, latency: float
) -> list[tuple[tuple[_Action, ...], float]]:
    """What ``a`` waits for: (any one of these finished actions, plus delay).
    Stages form chains of ``chain_length``: no data crosses a chain's end."""
    s, kind, m = a.stage_index, a.computation_type, a.microbatch_index
    rank = stage_to_rank[s]
    if kind == F:
        if s % chain_length == 0:
            return []
        if stage_to_rank[s - 1] == rank:
            return [((_Action(s - 1, F, m),), 0.0)]
        return [((_Action(s - 1, SEND_F, m),), latency)]
    if kind in (B, I):
        own = ((_Action(s, F, m),), 0.0)
        if s % chain_length == chain_length - 1:
            return [own]
        if stage_to_rank[s + 1] == rank:
            return [own, ((_Action(s + 1, B, m), _Action(s + 1, I, m)), 0.0)]
        return [own, ((_Action(s + 1, SEND_B, m),), latency)]
    if kind == W:
        return [((_Action(s, I, m),), 0.0)]
    if kind == SEND_F:
        return [((_Action(s, F, m),), 0.0)]
    if kind == SEND_B:
        return [((_Action(s, B, m), _Action(s, I, m)), 0.0)]
    return []  # RECV_* only post a receive; UNSHARD, RESHARD, REDUCE_GRAD


def _run(
    steps: dict[int, list[tuple[int, _Action]]],
    stage_to_rank: dict[int, int],
    chain_length: int,
    duration: Callable[[_Action], float],
    latency: float,
    list_kind: str,
) -> tuple[dict[int, list[Interval]], Deadlock | None]:
    """Run every rank's list in order; the times are final once known, so
    advancing ranks round-robin as far as their inputs allow is exact."""
    # An OVERLAP_F_B runs its sub-actions in sequence, each waiting for its inputs.
    flat = {r: [(i, leaf) for i, a in acts for leaf in _compute_leaves(a)] for r, acts in steps.items()}
    finished: dict[_Action, float] = {}
    clock = dict.fromkeys(flat, 0.0)
    pos = dict.fromkeys(flat, 0)
    timeline: dict[int, list[Interval]] = {r: [] for r in flat}
    waiting: dict[int, tuple[_Action, ...]] = {}
    while True:
        progress = False
        for r, acts in flat.items():
            while pos[r] < len(acts):
                a = acts[pos[r]][1]
                needs = _needs(a, stage_to_rank, chain_length, latency)
                missing = next((opts for opts, _ in needs if not any(o in finished for o in opts)), None)
                if missing is not None:
                    waiting[r] = missing
                    break
                start = max(
                    [clock[r]] + [min(finished[o] for o in opts if o in finished) + d for opts, d in needs]
                )
                end = start + duration(a) if a.is_compute_op else start
                if a.is_compute_op:
                    timeline[r].append((start, end, a))
                finished[a] = clock[r] = end
                pos[r] += 1
                progress = True
        if all(pos[r] == len(acts) for r, acts in flat.items()):
            return timeline, None
        if not progress:
            stuck = tuple(
                StuckRank(
                    r,
                    acts[pos[r]][0],
                    str(acts[pos[r]][1]),
                    " or ".join(f"{o} on rank {stage_to_rank[o.stage_index]}" for o in waiting[r]),
                )
                for r, acts in flat.items()
                if pos[r] < len(acts)
            )
            return timeline, Deadlock(list_kind, stuck)


# --------------------------------------------------------------------------
# Costs


def unit_times(config: SimConfig, lengths: list[int]) -> UnitTimes:
    """Per-unit times of ``config.cost`` for subsequences ``lengths`` (see the module docstring)."""
    total = sum(lengths)
    if config.cost == "uniform":
        fwd = tuple(length / total for length in lengths)
        return UnitTimes(F=fwd, B=tuple(2 * t for t in fwd), I=fwd, W=fwd)
    if config.cost == "transformer":
        cost = _model_cost(config.flavor)
        norm = cost.forward(total, 0)
        prefixes = [sum(lengths[:j]) for j in range(len(lengths))]

        def per_unit(pass_cost: Callable[[float, float], float]) -> tuple[float, ...]:
            return tuple(pass_cost(length, p) / norm for length, p in zip(lengths, prefixes))

        inp, wgt = per_unit(cost.backward_input), per_unit(cost.backward_weight)
        return UnitTimes(F=per_unit(cost.forward), B=tuple(i + w for i, w in zip(inp, wgt)), I=inp, W=wgt)
    return _load_times(Path(config.cost), len(lengths))


def _load_times(path: Path, k: int) -> UnitTimes:
    if not path.is_file():
        raise ValueError(f"--cost {path}: not 'uniform', 'transformer' or an existing JSON file")
    data = json.loads(path.read_text())
    passes: dict[str, tuple[float, ...] | None] = {}
    for name in ("F", "B", "I", "W"):
        times = data.get(name)
        if times is not None and len(times) != k:
            raise ValueError(f"{path}: {name!r} has {len(times)} times, the schedule has {k} subsequences")
        passes[name] = None if times is None else tuple(float(t) for t in times)
    if passes["B"] is None and passes["I"] is not None and passes["W"] is not None:
        passes["B"] = tuple(i + w for i, w in zip(passes["I"], passes["W"]))
    if passes["F"] is None or passes["B"] is None:
        raise ValueError(f"{path}: needs 'F' and either 'B' or both 'I' and 'W'")
    return UnitTimes(**passes)


def _model_cost(flavor: str) -> UnitCost:
    # Imported here: the model pulls in torchtitan, which uniform costs never need.
    from .model import seq_llama3_flavors

    if flavor not in seq_llama3_flavors:
        raise ValueError(f"unknown flavor {flavor!r}: use one of {sorted(seq_llama3_flavors)}")
    return UnitCost.from_model_args(seq_llama3_flavors[flavor])


def _lengths(config: SimConfig) -> list[int]:
    cost = _model_cost(config.flavor) if config.partition != "even" else None
    return partition_sequence(config.seq_len, config.subsequences, config.partition, cost=cost)


# --------------------------------------------------------------------------
# Simulation


def simulate(config: SimConfig) -> SimResult:
    """Build, validate, lower and time ``config``'s schedule.

    Raises :class:`~torchtitan_seq.ordering.ScheduleOrderError` for a sequence
    schedule that breaks an ordering rule, ValueError for a shape the schedule
    does not support; a deadlock is reported in the result.
    """
    built = _build(config)
    lengths = _lengths(config)
    return simulate_order(
        built.order,
        lengths=lengths,
        times=unit_times(config, lengths),
        stages_per_rank=built.stages_per_rank,
        placement=built.placement,
        schedule=config.schedule,
        microbatches=config.microbatches,
        split_backward=config.split_backward,
        cost=config.cost,
        parameter_copies=built.parameter_copies,
        comm_latency=config.comm_latency,
    )


def simulate_order(
    order: ActionLists,
    *,
    lengths: list[int],
    times: UnitTimes,
    microbatches: int,
    stages_per_rank: int = 1,
    placement: str | None = None,
    schedule: str = "custom",
    split_backward: bool = False,
    cost: str = "custom",
    parameter_copies: int = 1,
    comm_latency: float = 0.0,
) -> SimResult:
    """Lower and time compute-only lists ``order`` ({rank: [action or None]}).

    ``lengths`` are the subsequence lengths (k = len(lengths)), ``times`` the
    unit times on a stage with 1/p of the layers. ``placement`` ("loop",
    "v" or "bidirectional"), when given, must agree with where the lists put
    the stages. With ``parameter_copies`` 2 the p v stages are two chains
    over p v / 2 model chunks (BSIPipe).
    """
    p, v, k = len(order), stages_per_rank, len(lengths)
    num_stages = p * v
    chain_length = num_stages // parameter_copies
    lowered, stage_to_rank = _lower(order, num_stages, microbatches * k, chain_length)
    if placement is not None:
        expected = (
            BidirectionalLayout(p, "linear").stage_to_rank()
            if placement == "bidirectional"
            else generate_stage_to_rank_mapping(p, num_stages, style=placement)
        )
        if stage_to_rank != expected:
            raise ValueError(
                f"{schedule} places stages on ranks {stage_to_rank}, but its stage_placement "
                f"{placement!r} means {expected}"
            )
    # A stage holds 1/chain_length of the model, a 1/p stage's p/chain_length.
    share = p / chain_length
    scaled = {
        kind: None if ts is None else tuple(t * share for t in ts)
        for kind, ts in ((F, times.F), (B, times.B), (I, times.I), (W, times.W))
    }
    used = {
        leaf.computation_type for acts in order.values() for a in acts if a for leaf in _compute_leaves(a)
    }
    missing = sorted(kind.value for kind in used if scaled[kind] is None)
    if missing:
        raise ValueError(f"{schedule} runs {missing} passes, but the cost {cost!r} has no times for them")

    def duration(a: _Action) -> float:
        return scaled[a.computation_type][a.microbatch_index % k]

    if lowered is not None:
        steps = {r: list(enumerate(acts)) for r, acts in lowered.items()}
        list_kind = "lowered"
    else:
        steps = _send_after_compute(order, stage_to_rank, chain_length)
        list_kind = "compute-only"
    timeline, deadlock = _run(steps, stage_to_rank, chain_length, duration, comm_latency, list_kind)

    makespan = max((iv[1] for ivs in timeline.values() for iv in ivs), default=0.0)
    busy = [sum(end - start for start, end, _ in timeline[r]) for r in sorted(timeline)]
    weights = [length / sum(lengths) * share for length in lengths]
    return SimResult(
        schedule=schedule,
        pp=p,
        microbatches=microbatches,
        subsequences=k,
        stages_per_rank=v,
        split_backward=split_backward,
        cost=cost,
        lengths=list(lengths),
        bubble_ratio=sum(1 - b / makespan for b in busy) / p if makespan else 0.0,
        makespan=makespan,
        peak_activations=[_peak(timeline[r], weights, k) for r in sorted(timeline)],
        parameter_copies=parameter_copies,
        deadlock=deadlock,
        timeline=timeline,
        compute_order=order,
        lowered=lowered or {},
    )


def _peak(intervals: list[Interval], weights: list[float], k: int) -> float:
    """Largest sum of live unit weights; a rank runs one action at a time, so
    the peak is reached right after some forward."""
    live = peak = 0.0
    for _, _, a in intervals:
        w = weights[a.microbatch_index % k]
        if a.computation_type == F:
            live += w
            peak = max(peak, live)
        elif a.computation_type in (B, W):
            live -= w
    return peak


# --------------------------------------------------------------------------
# Outputs


def compute_csv(result: SimResult) -> str:
    """The compute-only lists as ``_PipelineScheduleRuntime._dump_csv(format="compute_only")``
    writes them (one row per rank, "" for an idle slot), loadable with ``_load_csv``."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    for rank in result.compute_order:
        writer.writerow(result.compute_order[rank])
    return buf.getvalue()


def chrome_trace(result: SimResult) -> dict:
    """Chrome/Perfetto trace: one process per rank, 1 time unit shown as 1 ms."""
    events: list[dict] = []
    k = result.subsequences
    for rank in sorted(result.timeline):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for start, end, a in result.timeline[rank]:
            m, j = divmod(a.microbatch_index, k)
            events.append(
                {
                    "name": str(a),
                    "cat": a.computation_type.value,
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": start * 1000,
                    "dur": (end - start) * 1000,
                    "args": {"stage": a.stage_index, "microbatch": m, "subsequence": j},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# tab10: distinct hues for microbatches; subsequences shade them dark to light.
_PALETTE = "#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf".split()
_HATCH = {  # pattern tiles (6 x 6) that mark backward passes
    B: '<path d="M0,6 L6,0 M-1,1 L1,-1 M5,7 L7,5" stroke="#000" stroke-opacity="0.55" stroke-width="1.2"/>',
    I: '<path d="M0,0 L6,6 M5,-1 L7,1 M-1,5 L1,7" stroke="#000" stroke-opacity="0.55" stroke-width="1.2"/>',
    W: '<circle cx="3" cy="3" r="1.2" fill="#000" fill-opacity="0.6"/>',
}
_PASS_NAMES = {F: "forward", B: "backward (B)", I: "input grad (I)", W: "weight grad (W)"}


def _colour(m: int, j: int, k: int) -> tuple[str, str]:
    """Fill of unit (m, j) and a text colour readable on it."""
    h, lightness, s = colorsys.rgb_to_hls(*(int(_PALETTE[m % 10][i : i + 2], 16) / 255 for i in (1, 3, 5)))
    if k > 1:
        lightness = 0.33 + 0.45 * j / (k - 1)
    fill = "#" + "".join(f"{round(c * 255):02x}" for c in colorsys.hls_to_rgb(h, lightness, s))
    return fill, "#000" if lightness > 0.6 else "#fff"


def _tick_step(span: float, target: int = 10) -> float:
    raw = span / target
    scale = 10 ** math.floor(math.log10(raw))
    return next(f * scale for f in (1, 2, 5, 10) if f * scale >= raw)


def _title(result: SimResult) -> str:
    shape = f"p={result.pp} N={result.microbatches} k={result.subsequences}"
    if result.stages_per_rank > 1:
        shape += f" V={result.stages_per_rank}"
    split = " (split backward)" if result.split_backward else ""
    return (
        f"{result.schedule}{split}  {shape}  cost={result.cost}  bubble ratio {result.bubble_ratio:.4f}  "
        f"makespan {result.makespan:.4g}  peak activations rank 0 {result.peak_activations[0]:.4g} M"
    )


def render_svg(result: SimResult, width: int = 1100) -> str:
    """The timeline as SVG: a row per rank, time on x; colour = microbatch,
    shade = subsequence (dark first), hatching/dots = backward passes, gaps = idle."""
    left, right, top, row_h, gap = 64, 16, 46, 30, 6
    plot_w = width - left - right
    p, k = result.pp, result.subsequences
    span = result.makespan or 1.0

    def x(t: float) -> float:
        return left + t * plot_w / span

    rows_bottom = top + p * (row_h + gap)
    legend_y = rows_bottom + 50
    height = legend_y + 24 + 18 * ((result.microbatches + 9) // 10)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        "<defs>",
        *(
            f'<pattern id="hatch-{kind.value}" width="6" height="6" patternUnits="userSpaceOnUse">{tile}</pattern>'
            for kind, tile in _HATCH.items()
        ),
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">{escape(_title(result))}</text>',
    ]
    if result.deadlock:
        out.append(
            f'<text x="{left}" y="34" font-size="11" fill="#c00">{escape(result.deadlock.describe())}</text>'
        )
    for r in range(p):
        y = top + r * (row_h + gap)
        out.append(f'<rect x="{left}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f3f3f3"/>')
        out.append(
            f'<text x="{left - 8}" y="{y + row_h / 2 + 4:.1f}" font-size="12" text-anchor="end">rank {r}</text>'
        )
        for start, end, a in result.timeline.get(r, []):
            m, j = divmod(a.microbatch_index, k)
            x0, x1 = x(start), x(end)
            kind = a.computation_type
            tip = f"{_PASS_NAMES[kind]} stage {a.stage_index} microbatch {m} subsequence {j}"
            tip += f" [{start:.4g}, {end:.4g}]"
            box = f'x="{x0:.2f}" y="{y}" width="{x1 - x0:.2f}" height="{row_h}"'
            fill, ink = _colour(m, j, k)
            out.append(
                f'<rect {box} fill="{fill}" stroke="#fff" stroke-width="0.6"><title>{tip}</title></rect>'
            )
            if kind in _HATCH:
                out.append(f'<rect {box} fill="url(#hatch-{kind.value})" pointer-events="none"/>')
            label = f"{m}.{j}" if k > 1 else f"{m}"
            if x1 - x0 >= 7 * len(label) + 4:
                out.append(
                    f'<text x="{(x0 + x1) / 2:.2f}" y="{y + row_h / 2 + 4:.1f}" font-size="10" '
                    f'text-anchor="middle" fill="{ink}" pointer-events="none">{label}</text>'
                )
    step = _tick_step(span)
    ticks = [i * step for i in range(int(span / step + 1e-9) + 1)]
    for t in ticks:
        out.append(
            f'<line x1="{x(t):.2f}" y1="{rows_bottom - gap}" x2="{x(t):.2f}" y2="{rows_bottom}" stroke="#444"/>'
        )
        out.append(
            f'<text x="{x(t):.2f}" y="{rows_bottom + 12}" font-size="10" text-anchor="middle">{t:.4g}</text>'
        )
    out.append(
        f'<text x="{left + plot_w}" y="{rows_bottom + 26}" font-size="10" text-anchor="end">'
        "time (forwards of one microbatch on 1/p of the layers)</text>"
    )
    # Legend: passes, then microbatch colours with their subsequence shades.
    lx = left
    for kind, name in _PASS_NAMES.items():
        box = f'x="{lx}" y="{legend_y - 10}" width="22" height="12"'
        out.append(f'<rect {box} fill="#9e9e9e"/>')
        if kind in _HATCH:
            out.append(f'<rect {box} fill="url(#hatch-{kind.value})"/>')
        out.append(f'<text x="{lx + 26}" y="{legend_y}" font-size="11">{name}</text>')
        lx += 34 + 7 * len(name)
    labels = "label m.j: microbatch m, subsequence j" if k > 1 else "label: microbatch"
    out.append(f'<text x="{lx + 10}" y="{legend_y}" font-size="11">{labels} (hover: stage, times)</text>')
    for m in range(result.microbatches):
        mx = left + (m % 10) * 100
        my = legend_y + 14 + 18 * (m // 10)
        for j in range(k):
            box = f'x="{mx + j * 40 / k:.2f}" y="{my}" width="{40 / k:.2f}" height="12"'
            out.append(f'<rect {box} fill="{_colour(m, j, k)[0]}"/>')
        out.append(f'<text x="{mx + 44}" y="{my + 10}" font-size="11">mb {m}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------
# The committed schedules/ folder


def standard_configs() -> list[SimConfig]:
    """The shapes of ``schedules/``: every sequence schedule and four of torch's
    at p=4, N=8 (k=4 for sequence schedules), plus Seq1F1B at N=4."""
    seq = [SimConfig(name, pp=4, microbatches=8, subsequences=4) for name in SEQUENCE_SCHEDULES]
    torch_ = [
        SimConfig(name, pp=4, microbatches=8)
        for name in ("1F1B", "Interleaved1F1B", "GPipe", "ZBVZeroBubble")
    ]
    return seq + torch_ + [SimConfig("Seq1F1B", pp=4, microbatches=4, subsequences=4)]


def _stem(result: SimResult) -> str:
    stem = f"{result.schedule}_pp{result.pp}_n{result.microbatches}_k{result.subsequences}"
    return stem + (f"_v{result.stages_per_rank}" if result.stages_per_rank > 1 else "")


def regenerate(folder: Path) -> list[Path]:
    """Write an SVG and a CSV per standard shape and README.md into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, written = [], []
    for config in standard_configs():
        result = simulate(config)
        stem = _stem(result)
        for suffix, text in ((".svg", render_svg(result)), (".csv", compute_csv(result))):
            path = folder / (stem + suffix)
            path.write_text(text, newline="")
            written.append(path)
        rows.append(
            f"| {result.schedule} | {result.pp} | {result.microbatches} | {result.subsequences} | "
            f"{result.stages_per_rank} | {result.bubble_ratio:.4f} | {result.makespan:.4g} | "
            f"{result.peak_activations[0]:.4g} | {result.parameter_copies} | "
            f"[svg]({stem}.svg) [csv]({stem}.csv) |"
        )
    readme = folder / "README.md"
    readme.write_text(
        "# Pipeline schedules, simulated\n\n"
        "Generated by `python -m torchtitan_seq.simulate --regenerate schedules`; do not edit.\n"
        "Uniform costs (a unit of a whole microbatch: F = 1, B = 2, I = W = 1, scaled by its share\n"
        "of the sequence and of the rank's layers), even subsequences, no communication latency.\n"
        "Time is in forwards of one microbatch on 1/p of the layers; activations in M, one\n"
        "microbatch's activations on 1/p of the layers. Each CSV is the compute-only action list\n"
        "(torch's `_dump_csv` format, loadable with `_load_csv`, but for BSIPipe's two chains).\n"
        "See `torchtitan_seq/simulate.py`.\n\n"
        "| schedule | p | N | k | V | bubble ratio | makespan | peak activations rank 0 (M) "
        "| parameter copies | files |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    return [*written, readme]


# --------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m torchtitan_seq.simulate",
        description="Timing simulation of pipeline schedules on torch's lowered action lists.",
    )
    ap.add_argument("--schedule", help=f"one of {sorted(SEQUENCE_SCHEDULES) + list(TORCH_SCHEDULES)}")
    ap.add_argument("--pp", type=int, help="p, pipeline ranks")
    ap.add_argument("--microbatches", type=int, help="N, microbatches per step")
    ap.add_argument("--subsequences", type=int, default=1, help="k, subsequences per microbatch")
    ap.add_argument("--stages-per-rank", type=int, help="V (default: the schedule's own)")
    ap.add_argument("--split-backward", action="store_true", help="sequence schedules: I and W instead of B")
    ap.add_argument(
        "--cost", default="uniform", help="uniform, transformer, or a JSON file of measured times"
    )
    ap.add_argument(
        "--flavor", default="debugmodel", help="model flavor (transformer cost, compute partition)"
    )
    ap.add_argument("--seq-len", type=int, default=2048, help="S, tokens per sequence")
    ap.add_argument("--partition", default="even", choices=PARTITIONS)
    ap.add_argument("--comm-latency", type=float, default=0.0, help="SEND to usable data, in time units")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--csv", type=Path, help="write the compute-only action table (torch's CSV format)")
    ap.add_argument("--svg", type=Path, help="write the timeline as SVG")
    ap.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace")
    ap.add_argument("--regenerate", type=Path, metavar="DIR", help="write the standard set into DIR and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.regenerate is not None:
        for path in regenerate(args.regenerate):
            print(path)
        return 0
    if args.schedule is None or args.pp is None or args.microbatches is None:
        ap.error("--schedule, --pp and --microbatches are required (or --regenerate DIR)")
    config = SimConfig(
        schedule=args.schedule,
        pp=args.pp,
        microbatches=args.microbatches,
        subsequences=args.subsequences,
        stages_per_rank=args.stages_per_rank,
        split_backward=args.split_backward,
        cost=args.cost,
        flavor=args.flavor,
        seq_len=args.seq_len,
        partition=args.partition,
        comm_latency=args.comm_latency,
    )
    try:
        result = simulate(config)
    except ValueError as e:  # includes ScheduleOrderError
        print(f"error: {e}", file=sys.stderr)
        return 2
    outputs = (
        (args.csv, lambda: compute_csv(result)),
        (args.svg, lambda: render_svg(result)),
        (args.trace, lambda: json.dumps(chrome_trace(result))),
    )
    for path, text in outputs:
        if path is not None:
            path.write_text(text(), newline="")
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(_title(result))
        print("peak activations per rank (M):", ", ".join(f"{a:.4g}" for a in result.peak_activations))
        if result.deadlock:
            print("DEADLOCK:", result.deadlock.describe())
    return 1 if result.deadlock else 0


if __name__ == "__main__":
    sys.exit(main())
