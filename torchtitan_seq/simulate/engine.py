"""The timing model: running lowered action lists rank by rank, and finding deadlocks.

Each rank executes its list (:mod:`.build`) in order, one action at a time,
like the runtime's loop. A compute action starts when the rank is free and
its inputs exist:

- F of stage s needs the output of the stage before it in its chain
  (:func:`~torchtitan_seq.schedules.ordering.fed_by`): the forward on the same rank, or
  the matching SEND_F on the rank that holds it, plus the transfer time;
- B or I of stage s needs its own F and the input gradient of the stage after
  it (B/I on the same rank, or the matching SEND_B plus the transfer time);
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

A transfer takes ``comm_latency`` plus, with a :class:`~.network.Network`
whose links cost time, the link's latency and the unit's bytes over its
bandwidth (:class:`~.network.Transfers`). Schedules with two copies of each
model chunk end the step with the copies' all-reduces between the ranks that
share chunks, once both have finished computing; the makespan includes them.

Pass times come from :mod:`.costs`, scaled to a stage's share of the layers, or,
from a calibration that timed every chunk, each stage's own chunk's. Activations: :mod:`.result`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining.schedules import SEND_B, SEND_F

from torchtitan_seq.instrumentation.render import Interval
from torchtitan_seq.runtime.torch_internals import Action
from torchtitan_seq.schedules import ActionLists
from torchtitan_seq.schedules.ordering import B, F, I, W, compute_leaves, fed_by
from torchtitan_seq.simulate.build import SimConfig, build, check_placement, lower, send_after_compute
from torchtitan_seq.simulate.costs import (
    ChunkTimes,
    UnitTimes,
    model_args,
    seconds_per_time_unit,
    stage_times,
    subsequence_lengths,
    unit_and_chunk_times,
)
from torchtitan_seq.simulate.network import Transfers
from torchtitan_seq.simulate.result import Deadlock, SimResult, StuckRank

__all__ = ["simulate", "simulate_order"]


Transfer = Callable[[int, int, int], float]
"""(source rank, destination rank, subsequence j) -> time from a SEND to its data on the destination."""

Key = tuple[int, Any, int]
"""An action as (stage, computation type, unit): a plain tuple, quicker to make than an ``Action``
(a NamedTuple, whose constructor runs in Python): the planner's simulations make one per action."""

_COMPUTE = frozenset({F, B, I, W})
"""The kinds of compute leaves (``Action.is_compute_op`` less OVERLAP_F_B, which runs as its leaves)."""

Need = tuple[tuple[Key, ...], int, int]
"""Any one of these finished actions, plus the transfer from rank to rank (-1, -1: none)."""


def _needs(a: Action, stage_to_rank: dict[int, int], chain_length: int, sends: bool) -> tuple[Need, ...]:
    """What ``a`` waits for; with ``sends``, an input from another rank comes with the SEND after the
    compute that made it, else straight from that compute (the same time: a SEND takes none, and
    the rank issues it right after the compute)."""
    s, kind, m = a.stage_index, a.computation_type, a.microbatch_index
    if kind == W:
        return ((((s, I, m),), -1, -1),)
    if kind == SEND_F:
        return ((((s, F, m),), -1, -1),)
    if kind == SEND_B:
        return ((((s, B, m), (s, I, m)), -1, -1),)
    if kind not in (F, B, I):
        return ()  # RECV_* only post a receive; UNSHARD, RESHARD, REDUCE_GRAD
    own = () if kind == F else ((((s, F, m),), -1, -1),)
    source = fed_by(a, chain_length)
    if source is None:
        return own
    made = ((source, F, m),) if kind == F else ((source, B, m), (source, I, m))
    if stage_to_rank[source] == stage_to_rank[s]:
        return (*own, (made, -1, -1))
    if sends:
        made = ((source, SEND_F if kind == F else SEND_B, m),)
    return (*own, (made, stage_to_rank[source], stage_to_rank[s]))


Compute = tuple[int, Action, tuple[tuple[tuple[int, ...], int, int], ...]]
"""A compute step of a shape's program (see :func:`_order`): its rank, its action, and per need the
program indices of the computes any one of which it waits for (the earliest to end counts; -1: the
start of the step, time 0) and the ranks a transfer goes from and to (-1, -1: none). A plain tuple,
as :data:`Key`."""


@dataclass(frozen=True)
class _Prepared:
    """A shape's lists reduced to what its timing takes, whatever the costs: every compute that runs,
    in an order in which what each waits for comes first."""

    lowered: dict[int, list[Action]] | None
    stage_to_rank: dict[int, int]
    program: tuple[Compute, ...]
    kinds: frozenset
    """The kinds of compute the lists run (F, B, I, W)."""
    ranks: tuple[int, ...]
    """The ranks, in the order of the timeline's keys."""
    deadlock: Deadlock | None
    """Where the ranks stop when not every step can run; the program then holds those that can."""


Steps = dict[int, list[tuple[int, Action]]]
"""Per rank, (index in the list a deadlock points into, compute leaf or communication) in run order."""


@functools.lru_cache(maxsize=256)
def _prepare(
    frozen: tuple[tuple[int, tuple[Action | None, ...]], ...],
    num_stages: int,
    num_units: int,
    chain_length: int,
    torch_lowering: bool,
) -> _Prepared:
    """Lower ``frozen`` (sorted (rank, actions) pairs) once per shape: the planner times one
    shape under many costs and networks."""
    order = {r: list(acts) for r, acts in frozen}
    if torch_lowering:
        lowered, stage_to_rank = lower(order, num_stages, num_units, chain_length)
    else:
        stage_to_rank = {
            leaf.stage_index: r
            for r, acts in order.items()
            for a in acts
            if a is not None
            for leaf in compute_leaves(a)
        }
        lowered = None
    kinds = frozenset(leaf.computation_type for acts in order.values() for a in acts if a for leaf in compute_leaves(a))
    if lowered is not None:
        listed = {r: list(enumerate(acts)) for r, acts in lowered.items()}
    else:  # the computes alone: an input from another rank takes its transfer from the compute that made it
        listed = {r: [(i, a) for i, a in enumerate(acts) if a is not None] for r, acts in order.items()}
    steps = _leaves(listed)
    program, pos, waiting = _order(steps, stage_to_rank, chain_length, sends=lowered is not None)
    deadlock = None
    if any(pos[r] < len(acts) for r, acts in steps.items()):
        if lowered is None:  # say where as the runtime would stop: at the SENDs after the computes
            steps = _leaves(send_after_compute(order, stage_to_rank, chain_length))
            program, pos, waiting = _order(steps, stage_to_rank, chain_length, sends=True)
        kind = "lowered" if lowered is not None else "compute-only"
        deadlock = _deadlock(steps, stage_to_rank, kind, pos, waiting)
    return _Prepared(lowered, stage_to_rank, tuple(program), kinds, tuple(steps), deadlock)


def _leaves(listed: dict[int, list[tuple[int, Action]]]) -> Steps:
    """``listed`` ({rank: [(index, action)]}) as :data:`Steps`: an OVERLAP_F_B runs its sub-actions
    in sequence, each waiting for its inputs."""
    return {r: [(i, leaf) for i, a in acts for leaf in compute_leaves(a)] for r, acts in listed.items()}


def _order(
    steps: Steps, stage_to_rank: dict[int, int], chain_length: int, sends: bool
) -> tuple[list[Compute], dict[int, int], dict[int, tuple[Key, ...]]]:
    """Every rank's steps in an order that runs each after what it waits for (:func:`_needs`;
    ``sends``: see there), advancing ranks round-robin as far as their inputs allow; which steps
    can run when does not depend on how long they take, so the order serves every cost.
    Communication steps take no time: one ends when its rank's latest compute does (what a SEND
    waits for ran on its own rank, before it), so what waits for it waits for that compute. Returns
    the computes, and per rank how far it got and, where it stopped, what it waits for (any one)."""
    needs = {r: [_needs(a, stage_to_rank, chain_length, sends) for _, a in acts] for r, acts in steps.items()}
    ended_with: dict[Key, int] = {}  # per action that ran, the compute it ends with (-1: none, time 0)
    latest = dict.fromkeys(steps, -1)  # per rank, its latest compute
    pos = dict.fromkeys(steps, 0)
    waiting: dict[int, tuple[Key, ...]] = {}
    program: list[Compute] = []
    while True:
        progress = False
        for r, acts in steps.items():
            i, last, rank_needs = pos[r], latest[r], needs[r]
            while i < len(acts):
                resolved = []
                for opts, src, dst in rank_needs[i]:
                    ran = tuple([ended_with[o] for o in opts if o in ended_with])
                    if not ran:
                        waiting[r] = opts
                        break
                    resolved.append((ran, src, dst))
                else:
                    a = acts[i][1]
                    if a.computation_type in _COMPUTE:
                        last = len(program)
                        program.append((r, a, tuple(resolved)))
                    ended_with[a[:3]] = last
                    i += 1
                    progress = True
                    continue
                break
            pos[r], latest[r] = i, last
        if not progress or all(pos[r] == len(acts) for r, acts in steps.items()):
            return program, pos, waiting


def _run(
    prepared: _Prepared, duration: Callable[[Action], float], transfer: Transfer, k: int
) -> dict[int, list[Interval]]:
    """Time the program (units of k subsequences): each compute starts once its rank is free and
    what it waits for has ended (plus the transfer from another rank)."""
    program = prepared.program
    ends = [0.0] * (len(program) + 1)  # per compute; the extra last one, index -1, is the step's start
    clock = dict.fromkeys(prepared.ranks, 0.0)
    timeline: dict[int, list[Interval]] = {r: [] for r in prepared.ranks}
    for i, (r, a, needs) in enumerate(program):
        start = clock[r]
        for ran, src, dst in needs:
            ready = ends[ran[0]] if len(ran) == 1 else min([ends[c] for c in ran])  # the first to end
            if src >= 0:
                ready += transfer(src, dst, a.microbatch_index % k)
            if ready > start:
                start = ready
        end = start + duration(a)
        timeline[r].append((start, end, a))
        ends[i] = clock[r] = end
    return timeline


def _deadlock(
    steps: Steps,
    stage_to_rank: dict[int, int],
    list_kind: str,
    pos: dict[int, int],
    waiting: dict[int, tuple[Key, ...]],
) -> Deadlock:
    """Where each unfinished rank stopped (``pos``) and what it waits for."""
    stuck = tuple(
        StuckRank(
            r,
            acts[pos[r]][0],
            str(acts[pos[r]][1]),
            " or ".join(f"{Action(*key)} on rank {stage_to_rank[key[0]]}" for key in waiting[r]),
        )
        for r, acts in steps.items()
        if pos[r] < len(acts)
    )
    return Deadlock(list_kind, stuck)


def simulate(config: SimConfig) -> SimResult:
    """Build, validate, lower and time ``config``'s schedule.

    Args:
        config: the schedule shape, its costs and its network.

    Returns:
        The timed step; a deadlock is reported in it, not raised.

    Raises:
        ScheduleOrderError: (a ValueError) for a sequence schedule that breaks an ordering rule.
        ValueError: for a shape the schedule does not support.
    """
    built = build(config)
    lengths = subsequence_lengths(config)
    times, chunk_times = unit_and_chunk_times(config, lengths)
    transfers = None
    if not config.network.free:
        num_chunks = config.pp * built.stages_per_rank // built.parameter_copies
        transfers = Transfers.for_model(
            config.network, model_args(config), lengths, num_chunks, seconds_per_time_unit(config)
        )
    return simulate_order(
        built.order,
        lengths=lengths,
        times=times,
        chunk_times=chunk_times,
        stages_per_rank=built.stages_per_rank,
        placement=built.placement,
        schedule=config.schedule,
        microbatches=config.microbatches,
        split_backward=config.split_backward,
        cost=config.cost,
        parameter_copies=built.parameter_copies,
        comm_latency=config.comm_latency,
        transfers=transfers,
        torch_lowering=config.torch_lowering,
    )


def simulate_order(
    order: ActionLists,
    *,
    lengths: list[int],
    times: UnitTimes,
    microbatches: int,
    chunk_times: ChunkTimes | None = None,
    stages_per_rank: int = 1,
    placement: str | None = None,
    schedule: str = "custom",
    split_backward: bool = False,
    cost: str = "custom",
    parameter_copies: int = 1,
    comm_latency: float = 0.0,
    transfers: Transfers | None = None,
    torch_lowering: bool = True,
) -> SimResult:
    """Lower and time compute-only lists.

    Args:
        order: per rank, its compute actions (None: an idle slot).
        lengths: the subsequence lengths; k = len(lengths).
        times: the unit times on a stage with 1/p of the layers.
        microbatches: N, microbatches per step.
        chunk_times: each model chunk's own times on its rank, taken instead where they cover every stage.
        stages_per_rank: v.
        placement: where the lists must put the stages ("loop", "v", "bidirectional"); None: unchecked.
        schedule: the schedule's name, for the result and its errors.
        split_backward: whether the lists split backward, for the result.
        cost: the cost's name, for the result.
        parameter_copies: 2: the p v stages are two chains over p v / 2 model chunks (BSIPipe, Chimera).
        comm_latency: time from every SEND to its data being usable on the receiving rank.
        transfers: the network's time for each transfer and for the copies' all-reduces; None: none.
        torch_lowering: see :class:`SimConfig`.

    Returns:
        The timed step; a deadlock is reported in it, not raised.
    """
    p, v, k = len(order), stages_per_rank, len(lengths)
    num_stages = p * v
    chain_length = num_stages // parameter_copies
    frozen = tuple((r, tuple(acts)) for r, acts in sorted(order.items()))
    prepared = _prepare(frozen, num_stages, microbatches * k, chain_length, torch_lowering)
    lowered, stage_to_rank = prepared.lowered, prepared.stage_to_rank
    if placement is not None:
        check_placement(stage_to_rank, placement, p, v, schedule)
    # A stage holds 1/chain_length of the model, a 1/p stage's p/chain_length.
    share = p / chain_length
    per_stage = stage_times(prepared.kinds, stage_to_rank, chain_length, share, times, chunk_times, schedule, cost)

    def duration(a: Action) -> float:
        return per_stage[a.stage_index][a.computation_type][a.microbatch_index % k]

    @functools.cache  # asked for every SEND; a few rank pairs and subsequences
    def transfer(src: int, dst: int, j: int) -> float:
        return comm_latency + (transfers.send(src, dst, j) if transfers else 0.0)

    timeline, deadlock = _run(prepared, duration, transfer, k), prepared.deadlock
    copies_synced = (
        _sync_copies(timeline, stage_to_rank, chain_length, parameter_copies, transfers) if parameter_copies > 1 else []
    )

    return SimResult(
        schedule=schedule,
        pp=p,
        microbatches=microbatches,
        subsequences=k,
        stages_per_rank=v,
        split_backward=split_backward,
        cost=cost,
        lengths=list(lengths),
        parameter_copies=parameter_copies,
        copies_synced=copies_synced,
        deadlock=deadlock,
        timeline=timeline,
        compute_order=order,
        lowered={r: list(acts) for r, acts in (lowered or {}).items()},
    )


def _sync_copies(
    timeline: dict[int, list[Interval]],
    stage_to_rank: dict[int, int],
    chain_length: int,
    copies: int,
    transfers: Transfers | None,
) -> list[float]:
    """Per rank, when the all-reduces of its chunks' copies end (see
    :meth:`~.network.Transfers.copy_sync`): the ranks that share chunks start
    once all of them have finished computing; chunk c's copies are stages
    c + i * chain_length."""
    shared: dict[tuple[int, ...], int] = {}
    for chunk in range(chain_length):
        ranks = tuple(sorted({stage_to_rank[chunk + i * chain_length] for i in range(copies)}))
        if len(ranks) > 1:
            shared[ranks] = shared.get(ranks, 0) + 1
    done = {r: max((end for _, end, _ in ivs), default=0.0) for r, ivs in timeline.items()}
    for ranks, chunks in sorted(shared.items()):
        end = max(done[r] for r in ranks) + (transfers.copy_sync(ranks, chunks) if transfers else 0.0)
        done.update(dict.fromkeys(ranks, end))
    return [done[r] for r in sorted(done)]
