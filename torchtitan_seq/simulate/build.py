"""Building a schedule's per-rank action lists and lowering them as the runtime does.

A schedule is first written as compute-only per-rank lists (F, B, I, W and
DualPipeV's OVERLAP_F_B): for a sequence schedule of
:data:`torchtitan_seq.schedules.SEQUENCE_SCHEDULES` by its ``actions_fn`` and
checked with :func:`~torchtitan_seq.schedules.ordering.validate_unit_order`; for one of
torch's (:data:`TORCH_SCHEDULES`) by instantiating torch's class on mock
stages and reading its ``pipeline_order`` (1F1B and GPipe run their own loop:
their IR is renumbered the way that loop counts microbatches, see
``_executed_order``). The lists are then lowered by torch's own
``_PipelineScheduleRuntime._prepare_schedule_with_comms`` on stand-in stages
(:func:`~torchtitan_seq.simulate.stand_in.torch_lowering`: whatever passes the
installed torch runs, 2.15's send waits included), and the lowered lists are
what :mod:`.engine` runs. Units are numbered ``m * k + j``
(microbatch m, subsequence j); torch's schedules have k = 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torch.distributed.pipelining.schedules import SEND_B, SEND_F, PipelineScheduleSingle, get_schedule_class

from torchtitan_seq.runtime.partition import Partition
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE
from torchtitan_seq.runtime.torch_internals import Action, stage_to_rank_mapping
from torchtitan_seq.schedules import (
    PLACEMENTS,
    SEQUENCE_SCHEDULES,
    TORCH_SCHEDULES,
    ActionLists,
    BidirectionalLayout,
    Placement,
    ScheduleShape,
    lower_chains,
)
from torchtitan_seq.schedules.ordering import B, F, compute_leaves, feeds, validate_unit_order
from torchtitan_seq.simulate.network import Network
from torchtitan_seq.simulate.stand_in import MockStage, torch_lowering

__all__ = ["SimConfig", "Built", "build", "stages_by_rank", "lower", "send_after_compute", "check_placement"]

# The V-shaped ones place two stages per rank as torchtitan does (stage_to_rank_mapping style "v").
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
    """Model flavor for the 'transformer' cost and the 'compute' partition: a Llama 3 flavor, or ``family:flavor``
    (:mod:`~torchtitan_seq.simulate.flavors`)."""
    seq_len: int = 2048
    """S, tokens per sequence."""
    partition: Partition = "even"
    """How sequences are cut: 'even', 'compute' or 'latency' (torchtitan_seq.runtime.partition)."""
    document_length: float = 0.0
    """Packed documents (block-causal attention): expected tokens per document, for the
    'transformer' cost and the partitions; 0: causal."""
    length_multiple: int = LENGTH_MULTIPLE
    """Every subsequence length is a multiple of this and of ``network.tensor_parallel``, as
    ``sequence_pipeline.length_multiple`` makes the runtime cut (:class:`~torchtitan_seq.runtime.shape.JobShape`)."""
    recompute: float = 0.0
    """Forwards recomputed per backward under activation checkpointing: 1 for ``full``,
    1/n for torchtitan's layer-level ``selective`` (every n-th block); added to B and I."""
    unit_overhead: float = 0.0
    """The 'transformer' cost only: seconds each unit's forward + backward costs per layer on
    top of its FLOPs (the fixed cost of :func:`~torchtitan_seq.simulate.costs.fit_unit_costs`
    per layer), converted at the network's FLOP/s; 0: none."""
    comm_latency: float = 0.0
    """Time from a SEND to the data being usable on the receiving rank, on top of the network's."""
    network: Network = field(default_factory=Network)
    """Links and what crosses them (:mod:`.network`); the default's are free."""
    bidirectional_placement: Placement = "paired"
    """Schedules of two opposite chains (stage_placement 'bidirectional'): position -> rank,
    as ``sequence_pipeline.bidirectional_placement``."""
    torch_lowering: bool = True
    """False: time the compute-only lists instead of torch's lowered lists, each input from another
    rank arriving its transfer after the compute that made it (as a SEND right after that compute
    would send it): the same timeline whenever torch can lower them (tested), without torch's FSDP
    pass, whose cost grows with the square of a list's length (the planner's setting)."""


@dataclass(frozen=True)
class Built:
    """A schedule's compute-only lists and how it places and copies its stages."""

    order: ActionLists
    stages_per_rank: int
    placement: str
    parameter_copies: int


def build(config: SimConfig) -> Built:
    """Compute-only lists of ``config``'s schedule, checked against its placement."""
    p, n, k = config.pp, config.microbatches, config.subsequences
    if config.schedule in SEQUENCE_SCHEDULES:
        cls = SEQUENCE_SCHEDULES[config.schedule]
        v = config.stages_per_rank or cls.stages_per_rank
        placement = cls.stage_placement
        shape = ScheduleShape(p, n, k, config.split_backward, v)
        order = {r: list(acts) for r, acts in _checked_order(cls, shape).items()}
        if placement == "bidirectional":  # lists keyed by position, as the runtime maps them
            layout = BidirectionalLayout(p, config.bidirectional_placement, v)
            order = {r: order[layout.position_of_rank(r)] for r in range(p)}
    elif config.schedule in TORCH_SCHEDULES:
        if k != 1 or config.split_backward:
            raise ValueError(
                f"{config.schedule} is torch's schedule: it runs whole microbatches "
                "(subsequences 1) and picks its own backward split"
            )
        cls, v, placement = _torch_layout(config.schedule, config.stages_per_rank)
        single = v == 1
        mapping = stage_to_rank_mapping(p, p * v, style=placement)
        stages = [MockStage(s, p * v, p) for s, r in mapping.items() if r == 0]
        sched = cls(stages[0] if single else stages, n)
        order = _executed_order(sched.pipeline_order) if single else sched.pipeline_order
    else:
        raise ValueError(
            f"unknown schedule {config.schedule!r}: use one of {sorted(SEQUENCE_SCHEDULES) + list(TORCH_SCHEDULES)}"
        )
    return Built(order, v, placement, getattr(cls, "parameter_copies", 1))


def _torch_layout(schedule: str, stages_per_rank: int | None) -> tuple[type, int, str]:
    """One of torch's schedules: its class, its stages per rank and their placement style."""
    cls = get_schedule_class(schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    v = stages_per_rank or (1 if single else 2)
    if (single and v != 1) or (not single and v < 2):
        raise ValueError(f"{schedule} runs {'one stage' if single else 'at least 2 stages'} per rank, not {v}")
    return cls, v, "v" if schedule in _TORCH_V_SCHEDULES else "loop"


@functools.lru_cache(maxsize=256)
def stages_by_rank(
    schedule: str, pp: int, stages_per_rank: int | None = None, bidirectional_placement: Placement = "paired"
) -> tuple[tuple[int, ...], ...]:
    """Per rank, the stages :func:`build`'s lists of ``schedule`` place on it (``stages_per_rank`` and
    ``bidirectional_placement`` as :class:`SimConfig`'s), without building the lists."""
    if schedule in SEQUENCE_SCHEDULES:
        cls = SEQUENCE_SCHEDULES[schedule]
        v = stages_per_rank or cls.stages_per_rank
        options = {"placement": bidirectional_placement} if cls.stage_placement == "bidirectional" else {}
        held = cls.place_stages(pp, pp * v // getattr(cls, "parameter_copies", 1), **options)
        return tuple(tuple(sorted(stage for stage, _ in stages)) for stages in held)
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(
            f"unknown schedule {schedule!r}: use one of {sorted(SEQUENCE_SCHEDULES) + list(TORCH_SCHEDULES)}"
        )
    _, v, placement = _torch_layout(schedule, stages_per_rank)
    mapping = stage_to_rank_mapping(pp, pp * v, style=placement)
    return tuple(tuple(sorted(s for s, r in mapping.items() if r == rank)) for rank in range(pp))


@functools.lru_cache(maxsize=512)
def _checked_order(cls: type, shape: ScheduleShape) -> ActionLists:
    """A sequence schedule's compute-only lists, validated; kept because placements and costs share
    the lists, and BSIPipe's list scheduling is costly at large shapes (callers copy them)."""
    order = cls.compute_order(shape)
    validate_unit_order(order, shape.num_subsequences)
    return order


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
                a = Action(a.stage_index, a.computation_type, count[a.computation_type])
                count[a.computation_type] += 1
            order[rank].append(a)
    return order


def lower(
    order: ActionLists, num_stages: int, num_units: int, chain_length: int
) -> tuple[dict[int, list[Action]] | None, dict[int, int]]:
    """torch's own lowering (``_prepare_schedule_with_comms`` of the installed torch); for
    stages in several chains (BSIPipe, Chimera), the schedule's own, as the runtime runs it
    (:func:`~torchtitan_seq.schedules.lower_chains`).

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
    return torch_lowering(order, num_stages, num_units)


def send_after_compute(
    order: ActionLists, stage_to_rank: dict[int, int], chain_length: int
) -> dict[int, list[tuple[int, Action]]]:
    """Compute-only lists with a SEND after each compute that feeds another rank;
    each entry keeps its compute's index so a deadlock points into ``order``.

    The stand-in for a lowering that torch's ``_add_send_recv`` rejects, to
    say where the lists deadlock."""
    out: dict[int, list[tuple[int, Action]]] = {}
    for rank, actions in order.items():
        steps: list[tuple[int, Action]] = []
        for i, a in enumerate(actions):
            if a is None:
                continue
            steps.append((i, a))
            for leaf in compute_leaves(a):
                target = feeds(leaf, chain_length)
                if target is not None and stage_to_rank[target] != rank:
                    send = SEND_F if leaf.computation_type == F else SEND_B
                    steps.append((i, Action(leaf.stage_index, send, leaf.microbatch_index)))
        out[rank] = steps
    return out


def check_placement(stage_to_rank: dict[int, int], placement: str, p: int, v: int, schedule: str) -> None:
    """Refuse lists that put the stages elsewhere than ``placement`` ("loop", "v" or "bidirectional":
    either of its placements) puts p v stages on p ranks."""
    expected = (
        [BidirectionalLayout(p, name, v).stage_to_rank() for name in PLACEMENTS]
        if placement == "bidirectional"
        else [stage_to_rank_mapping(p, p * v, style=placement)]
    )
    if stage_to_rank not in expected:
        raise ValueError(
            f"{schedule} places stages on ranks {stage_to_rank}, but its stage_placement "
            f"{placement!r} means {' or '.join(map(str, expected))}"
        )
