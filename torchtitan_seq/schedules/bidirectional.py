"""Two pipelines in opposite directions over the same ranks: BSIPipe's and Chimera's layouts.

Pipeline A runs the model's chunks down the ranks, pipeline B runs the same
chunks from the other end: B's chunk s sits on position p - 1 - (A's position
of s). Two shapes (:data:`SHAPES`):

* ``v`` (BSIPipe): the model is cut into 2p chunks and A runs them down and
  back up the ranks in a V: chunk s on position s for s < p, on position
  2p - 1 - s after the turn. Position q holds chunks {q, 2p - 1 - q} of A and
  {p - 1 - q, p + q} of B.
* ``straight`` (Chimera): the model is cut into p chunks, A's chunk s on
  position s. Position q holds chunk q of A and chunk p - 1 - q of B.

Either way the mirror of position q, p - 1 - q, holds the same chunks with the
roles swapped: every chunk exists twice, once on each rank of a mirrored pair.

torch numbers stages along one chain; here the two chains share one index
space, A's chunk s is stage s and B's chunk s is stage ``chain_length`` + s
(``chain_length`` = 2p or p), and a stage is first or last of its chain.
torch's lowering (``_add_send_recv``) knows only one chain, so
:func:`lower_chains` adds sends and receives the same way with chain
boundaries; FSDP actions and gradient reduction are still torch's.

Positions are mapped to ranks by a placement: ``paired`` (default) puts each
mirrored pair (q, p - 1 - q) on neighbouring ranks (2q, 2q + 1), where their
gradient all-reduce is cheapest; ``linear`` puts position q on rank q.
:class:`MirroredCopies` keeps the two copies of each chunk identical;
:class:`BidirectionalSchedule` is the runtime both schedules share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    _Action,
    _add_reduce_grad,
    _add_unshard_reshard,
)
from torch.distributed.tensor import DTensor

from ..ordering import B, F, I, fed_by, feeds
from ..stage import SequencePipelineStage
from .base import SequenceSchedule, StagePlacement

__all__ = [
    "PLACEMENTS", "SHAPES", "Shape", "BidirectionalLayout", "check_bidirectional_shape", "lower_chains",
    "MirroredCopies", "BidirectionalSchedule",
]

PLACEMENTS = ("paired", "linear")

Shape = Literal["v", "straight"]
SHAPES: dict[Shape, int] = {"v": 4, "straight": 2}
"""Stages per rank of each shape: 2 chunks of each chain in a V, 1 in a straight chain."""


@dataclass(frozen=True)
class BidirectionalLayout:
    """Where the stages of the two chains live on p ranks (p even)."""

    num_positions: int
    """p, pipeline ranks."""
    placement: str = "paired"
    """Position -> rank: 'paired' (mirrored pairs on neighbouring ranks) or 'linear'."""
    shape: Shape = "v"
    """'v' (BSIPipe: chains of 2p chunks) or 'straight' (Chimera: chains of p chunks)."""

    def __post_init__(self) -> None:
        p = self.num_positions
        if p < 2 or p % 2:
            raise ValueError(
                f"BSIPipe and Chimera pair pipeline rank q with rank p - 1 - q, so they need an even "
                f"pipeline_parallel_degree, got {p}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"sequence_pipeline.bidirectional_placement = {self.placement!r} is unknown: "
                f"use one of {PLACEMENTS}"
            )
        if self.shape not in SHAPES:
            raise ValueError(f"bidirectional layout shape {self.shape!r} is unknown: use one of {tuple(SHAPES)}")

    @classmethod
    def holding(cls, num_positions: int, stages_per_rank: int, placement: str = "paired") -> BidirectionalLayout:
        """The layout whose ranks hold ``stages_per_rank`` stages (the shape that has that many)."""
        shape = next((s for s, v in SHAPES.items() if v == stages_per_rank), None)
        if shape is None:
            raise ValueError(f"no bidirectional layout holds {stages_per_rank} stages per rank: {SHAPES}")
        return cls(num_positions, placement, shape)

    @property
    def stages_per_rank(self) -> int:
        return SHAPES[self.shape]

    @property
    def chain_length(self) -> int:
        """Stages per chain (2p in a V, p straight); the chains' chunks are the model's."""
        return self.num_positions * self.stages_per_rank // 2

    @property
    def num_stages(self) -> int:
        return 2 * self.chain_length

    def position_of_stage(self, stage: int) -> int:
        p = self.num_positions
        chain, s = divmod(stage, self.chain_length)
        q = s if s < p else 2 * p - 1 - s
        return q if chain == 0 else p - 1 - q

    def rank_of_position(self, q: int) -> int:
        if self.placement == "linear":
            return q
        p = self.num_positions
        return 2 * q if q < p // 2 else 2 * (p - 1 - q) + 1

    def position_of_rank(self, rank: int) -> int:
        return next(q for q in range(self.num_positions) if self.rank_of_position(q) == rank)

    def rank_of_stage(self, stage: int) -> int:
        return self.rank_of_position(self.position_of_stage(stage))

    def stage_to_rank(self) -> dict[int, int]:
        return {s: self.rank_of_stage(s) for s in range(self.num_stages)}

    def stages_of_rank(self, rank: int) -> list[int]:
        """The rank's stages, ascending: A's chunks, then B's."""
        return [s for s in range(self.num_stages) if self.rank_of_stage(s) == rank]

    def chunk(self, stage: int) -> int:
        """The model chunk a stage runs."""
        return stage % self.chain_length

    def mirror(self, rank: int) -> int:
        return self.rank_of_position(self.num_positions - 1 - self.position_of_rank(rank))

    def describe(self) -> str:
        """One line per rank: its position, A and B chunks, and its mirror."""
        lines = []
        for rank in range(self.num_positions):
            a, b = (
                [self.chunk(s) for s in self.stages_of_rank(rank) if s // self.chain_length == chain]
                for chain in (0, 1)
            )
            lines.append(
                f"rank {rank}: position {self.position_of_rank(rank)}, chunks A {a} B {b}, "
                f"mirrored with rank {self.mirror(rank)}"
            )
        return "\n".join(lines)


def check_bidirectional_shape(
    schedule: str,
    shape: Shape,
    num_ranks: int,
    num_microbatches: int,
    split_backward: bool,
    stages_per_rank: int | None = None,
    placement: str = "paired",
) -> BidirectionalLayout:
    """Raise, naming the setting, for a shape the two-direction ``schedule`` cannot run; else its layout."""
    layout = BidirectionalLayout(num_ranks, placement, shape)  # an even p, a known placement
    v = layout.stages_per_rank
    if stages_per_rank not in (None, v):
        raise ValueError(f"{schedule} holds {v} stages per rank ({v // 2} of each chain), not {stages_per_rank}")
    if split_backward:
        # torch's input/weight split special-cases stage 0, which would miss chain B's first stage.
        raise ValueError(f"{schedule} runs full backwards: set sequence_pipeline.split_backward = false")
    if num_microbatches % 2:
        raise ValueError(
            f"{schedule} shares the microbatches between its two pipelines, so it needs an even "
            f"number of them, got {num_microbatches}: change training.local_batch_size or "
            "parallelism.pipeline_parallel_microbatch_size"
        )
    return layout


def lower_chains(
    order: dict[int, list[_Action | None]],
    stage_to_rank: dict[int, int],
    chain_length: int,
    units_per_stage: int,
) -> dict[int, list[_Action]]:
    """Compute-only lists -> the lists the runtime runs, for stages in chains of ``chain_length``.

    torch's ``_add_unshard_reshard`` and ``_add_reduce_grad`` per rank, then
    sends and receives placed as torch's ``_add_send_recv`` places them: the
    ranks advance in lock step, an action waits until its input was sent to it
    (or made on the same rank), and a receive is posted on the receiving rank
    when the send is issued, so every pair of ranks posts its transfers in the
    same order. The only difference is that no transfer crosses the end of a
    chain.
    """

    def comms(a: _Action) -> tuple[_Action, _Action] | None:
        s, u, n = a.stage_index, a.microbatch_index, feeds(a, chain_length)
        if n is None or stage_to_rank[n] == stage_to_rank[s]:
            return None
        if a.computation_type == F:
            return _Action(s, SEND_F, u), _Action(n, RECV_F, u)
        return _Action(s, SEND_B, u), _Action(n, RECV_B, u)

    def ready(a: _Action, seen: set[_Action]) -> bool:
        s, kind, u, n = a.stage_index, a.computation_type, a.microbatch_index, fed_by(a, chain_length)
        if n is None:
            return True
        if kind == F:
            return _Action(s, RECV_F, u) in seen or _Action(n, F, u) in seen
        return any(x in seen for x in (_Action(s, RECV_B, u), _Action(n, B, u), _Action(n, I, u)))

    pending = {
        r: [a for a in _add_reduce_grad(_add_unshard_reshard(acts), units_per_stage) if a is not None]
        for r, acts in order.items()
    }
    lowered: dict[int, list[_Action]] = {r: [] for r in order}
    seen: dict[int, set[_Action]] = {r: set() for r in order}
    while any(pending.values()):
        progress = False
        for r in sorted(pending):
            if not pending[r] or not ready(pending[r][0], seen[r]):
                continue
            a = pending[r].pop(0)
            lowered[r].append(a)
            seen[r].add(a)
            pair = comms(a)
            if pair is not None:
                send, recv = pair
                dst = stage_to_rank[recv.stage_index]
                lowered[r].append(send)
                seen[r].add(send)
                lowered[dst].append(recv)
                seen[dst].add(recv)
            progress = True
        if not progress:
            stuck = {r: str(acts[0]) for r, acts in pending.items() if acts}
            raise ValueError(f"no order of sends and receives runs these lists: ranks stuck at {stuck}")
    return lowered


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MirroredCopies:
    """The two copies of this rank's model chunks and of its mirror's, kept identical.

    Chain A's copy of a chunk is the primary: after a step
    :meth:`combine_gradients` adds the mirror copy's gradient to it (one
    all-reduce per pair, on one flat buffer) and drops the mirror copy's, so
    the optimizer steps each chunk once and gradient-norm clipping counts it
    once; :meth:`sync_parameters` then copies the primaries' new values over
    the mirror copies (one all-reduce again). Both ranks of a pair hold the same
    chunks, which fixes a common order: by chunk index.

    Args:
        modules: {stage index: module} of this rank's stages.
        layout: the stages' layout.
        pp_group: the pipeline's process group (its group ranks are the layout's ranks).
    """

    def __init__(self, modules: dict[int, nn.Module], layout: BidirectionalLayout, pp_group: dist.ProcessGroup) -> None:
        by_chunk = sorted(modules, key=layout.chunk)
        self._modules = [modules[s] for s in by_chunk]
        self._primary = [s < layout.chain_length for s in by_chunk]
        self._group = _pair_group(layout, pp_group)

    @property
    def _params(self) -> list[list[nn.Parameter]]:
        # Read at each use: torchtitan materialises meta parameters after the schedule is built.
        return [list(m.parameters()) for m in self._modules]

    def _all_reduce(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat, group=self._group)
        return flat

    @torch.no_grad()
    def combine_gradients(self) -> None:
        """Primary grad <- primary + mirror grad (over the pair); mirror grads -> None."""
        for params, primary in zip(self._params, self._primary):
            for p in params:
                if primary and p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [
            _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
            for params in self._params
            for p in params
        ]
        summed = iter(_unflatten_dense_tensors(self._all_reduce(grads), grads))
        for params, primary in zip(self._params, self._primary):
            for p in params:
                total = next(summed)
                if primary:
                    _local(p.grad).copy_(total)
                else:
                    p.grad = None

    def _pair_sum(self, mirror_value) -> list[torch.Tensor]:
        """Per parameter, the pair's sum of this rank's primaries and ``mirror_value(p)`` of its mirror copies."""
        values = [
            _local(p).detach() if primary else mirror_value(_local(p).detach())
            for params, primary in zip(self._params, self._primary)
            for p in params
        ]
        return _unflatten_dense_tensors(self._all_reduce(values), values)

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """Mirror copies <- primary copies (over the pair)."""
        summed = iter(self._pair_sum(torch.zeros_like))
        for params, primary in zip(self._params, self._primary):
            for p in params:
                total = next(summed)
                if not primary:
                    _local(p).copy_(total)

    @torch.no_grad()
    def max_difference(self) -> float:
        """Largest |primary - mirror| over this pair's chunks (0.0: the copies are identical)."""
        return max((float(d.abs().max()) for d in self._pair_sum(torch.neg) if d.numel()), default=0.0)


def _pair_group(layout: BidirectionalLayout, pp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """This rank's mirrored pair as a process group.

    ``new_group`` must be called by every process for every group, so the
    pipelines of all data- and tensor-parallel coordinates are gathered first.
    """
    mine = dist.get_process_group_ranks(pp_group)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    pairs = sorted({
        tuple(sorted((ranks[r], ranks[layout.mirror(r)])))
        for ranks in map(tuple, everyone)
        for r in range(layout.num_positions)
    })
    me = dist.get_rank()
    group = None
    for pair in pairs:
        g = dist.new_group(list(pair))
        if me in pair:
            group = g
    return group


class BidirectionalSchedule(SequenceSchedule):
    """The runtime of a schedule of two pipelines in opposite directions (BSIPipe, Chimera).

    A subclass names its ``layout_shape`` (and so its ``stages_per_rank``) and
    its ``actions_fn``, whose lists are keyed by pipeline position and number
    the stages as :class:`BidirectionalLayout` does. The two copies of each
    chunk are one model: a step starts from identical copies (the first step
    copies A's over B's) and ends with each chunk's whole gradient on its
    chain-A copy and none on its chain-B copy, so an optimizer over all
    parameters steps each chunk once; call :meth:`sync_copies` after each
    optimizer step (the trainer's hook :meth:`after_optimizer_step` does).
    ``step()`` returns no outputs: each last stage sees half of the microbatches.

    Args (beyond :class:`SequenceSchedule`'s):
        placement: position -> rank, see :data:`PLACEMENTS`.
    """

    layout_shape: ClassVar[Shape]
    parameter_copies = 2
    stage_placement = "bidirectional"

    def __init__(
        self,
        stages: list[SequencePipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        split_backward: bool = False,
        scale_grads: bool = False,
        placement: str = "paired",
    ) -> None:
        self.layout = BidirectionalLayout(stages[0].group_size, placement, self.layout_shape)
        held = sorted(s.stage_index for s in stages)
        if held != self.layout.stages_of_rank(stages[0].group_rank):
            raise ValueError(
                f"pipeline rank {stages[0].group_rank} holds stages {held}, but {self._name()}'s "
                f"{placement!r} layout puts {self.layout.stages_of_rank(stages[0].group_rank)} there"
            )
        super().__init__(stages, n_microbatches, loss_fn, split_backward=split_backward, scale_grads=scale_grads)
        self.copies = MirroredCopies({s.stage_index: s.submod for s in self._stages}, self.layout, stages[0].group)
        self._copies_synced = False

    @classmethod
    def _name(cls) -> str:
        return cls.__name__.removeprefix("Schedule")

    def _prepare_schedule_with_comms(self, actions, format="compute_only"):
        order = {self.layout.rank_of_position(q): acts for q, acts in actions.items()}
        self.pipeline_order = order
        self.stage_index_to_group_rank = self.layout.stage_to_rank()
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.pipeline_order_with_comms = lower_chains(
            order, self.stage_index_to_group_rank, self.layout.chain_length, self._n_microbatches // 2
        )

    @classmethod
    def check_shape(cls, num_ranks: int, num_microbatches: int, num_subsequences: int, *,
                    split_backward: bool = False, placement: str = "paired") -> None:
        # Without building the lists: BSIPipe's list scheduling takes seconds at large shapes.
        check_bidirectional_shape(
            cls._name(), cls.layout_shape, num_ranks, num_microbatches, split_backward, placement=placement
        )

    @classmethod
    def options_from_config(cls, config: Any) -> dict[str, Any]:
        return {"placement": config.bidirectional_placement}

    @classmethod
    def place_stages(cls, num_ranks: int, num_chunks: int, placement: str = "paired") -> StagePlacement:
        layout = BidirectionalLayout(num_ranks, placement, cls.layout_shape)
        if num_chunks != layout.chain_length:
            raise ValueError(
                f"{cls._name()} cuts the model into {layout.chain_length} chunks "
                f"({layout.stages_per_rank // 2} per pipeline rank and direction), got {num_chunks}"
            )
        return [[(s, layout.chunk(s)) for s in layout.stages_of_rank(r)] for r in range(num_ranks)]

    def describe(self) -> str:
        return f"{self._name()} placement '{self.layout.placement}':\n{self.layout.describe()}"

    def after_optimizer_step(self) -> None:
        self.sync_copies()

    def sync_copies(self) -> None:
        """Copy each chunk's chain-A values over its chain-B copy (after an optimizer step)."""
        self.copies.sync_parameters()
        self._copies_synced = True

    def step(self, *args, target=None, losses=None, return_outputs: bool = True, **kwargs) -> None:
        if not self._copies_synced:
            self.sync_copies()
        super().step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self._has_backward:
            self.copies.combine_gradients()
