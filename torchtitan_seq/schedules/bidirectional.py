"""Two pipelines in opposite directions over the same ranks: BSIPipe's and Chimera's layouts.

Pipeline A runs the model's chunks down the ranks, pipeline B the same chunks from the other end,
so position q and its mirror p - 1 - q hold the same chunks with the roles swapped: every chunk
exists twice, on a mirrored pair. Two shapes, by stages per rank:

* 4, a V (BSIPipe): 2p chunks, A runs them down and back up in a V (chunk s on position s for
  s < p, on 2p - 1 - s after the turn); position q holds chunks {q, 2p - 1 - q} of A and
  {p - 1 - q, p + q} of B.
* 2, straight (Chimera): p chunks, A's chunk s on position s; position q holds chunk q of A and
  chunk p - 1 - q of B.

The chains share one stage index space: A's chunk s is stage s, B's is stage ``chain_length`` + s. A
schedule's lists are keyed by position and send even microbatches down A, odd ones down B, with full
backwards only (torch's input/weight split special-cases stage 0, which would miss chain B's first
stage). A placement maps positions to ranks: ``paired`` (default) puts each mirrored pair on
neighbouring ranks (2q, 2q + 1), where their gradient all-reduce is cheapest; ``linear`` puts
position q on rank q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import RECV_B, RECV_F, SEND_B, SEND_F
from torch.distributed.tensor import DTensor

from torchtitan_seq.runtime.torch_internals import (
    Action,
    add_reduce_grad,
    add_send_waits,
    add_unshard_reshard,
    persistent_buffers,
)
from torchtitan_seq.schedules.base import ScheduleShape, SequenceSchedule, StagePlacement
from torchtitan_seq.schedules.ordering import B, F, I, fed_by, feeds
from torchtitan_seq.schedules.stage import SequencePipelineStage

__all__ = ["Placement", "PLACEMENTS", "BidirectionalLayout", "lower_chains", "MirroredCopies", "BidirectionalSchedule"]

Placement = Literal["paired", "linear"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


@dataclass(frozen=True)
class BidirectionalLayout:
    """Where the stages of the two chains live on p ranks (p even)."""

    num_positions: int
    """p, pipeline ranks."""
    placement: Placement = "paired"
    """Position -> rank: 'paired' (mirrored pairs on neighbouring ranks) or 'linear'."""
    stages_per_rank: Literal[2, 4] = 4
    """4: a V (BSIPipe: chains of 2p chunks); 2: straight (Chimera: chains of p chunks)."""

    def __post_init__(self) -> None:
        p = self.num_positions
        if p < 2 or p % 2:
            raise ValueError(
                f"BSIPipe and Chimera pair pipeline rank q with rank p - 1 - q, so they need an even "
                f"pipeline_parallel_degree, got {p}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"sequence_pipeline.bidirectional_placement = {self.placement!r} is unknown: use one of {PLACEMENTS}"
            )
        if self.stages_per_rank not in (2, 4):
            raise ValueError(
                f"a bidirectional layout holds 2 (straight) or 4 (V) stages per rank, not {self.stages_per_rank}"
            )

    @property
    def chain_length(self) -> int:
        """Stages per chain (2p in a V, p straight); the chains' chunks are the model's."""
        return self.num_positions * self.stages_per_rank // 2

    def rank_of_position(self, q: int) -> int:
        p = self.num_positions
        return q if self.placement == "linear" else 2 * q if q < p // 2 else 2 * (p - 1 - q) + 1

    def position_of_rank(self, rank: int) -> int:
        return next(q for q in range(self.num_positions) if self.rank_of_position(q) == rank)

    def rank_of_stage(self, stage: int) -> int:
        p = self.num_positions
        chain, s = divmod(stage, self.chain_length)
        q = s if s < p else 2 * p - 1 - s  # chain A's position
        return self.rank_of_position(q if chain == 0 else p - 1 - q)

    def stage_to_rank(self) -> dict[int, int]:
        return {s: self.rank_of_stage(s) for s in range(2 * self.chain_length)}

    def stages_of_rank(self, rank: int) -> list[int]:
        """The rank's stages, ascending: A's chunks, then B's."""
        return [s for s, r in self.stage_to_rank().items() if r == rank]

    def chunk(self, stage: int) -> int:
        """The model chunk a stage runs."""
        return stage % self.chain_length

    def mirror(self, rank: int) -> int:
        return self.rank_of_position(self.num_positions - 1 - self.position_of_rank(rank))

    def describe(self) -> str:
        """One line per rank: its position, A and B chunks, and its mirror."""
        lines = []
        for rank in range(self.num_positions):
            a, b = ([self.chunk(s) for s in self.stages_of_rank(rank) if s // self.chain_length == c] for c in (0, 1))
            lines.append(
                f"rank {rank}: position {self.position_of_rank(rank)}, chunks A {a} B {b}, "
                f"mirrored with rank {self.mirror(rank)}"
            )
        return "\n".join(lines)


def lower_chains(
    order: dict[int, list[Action | None]], stage_to_rank: dict[int, int], chain_length: int, units_per_stage: int
) -> dict[int, list[Action]]:
    """Compute-only lists -> the lists the runtime runs, for stages in chains of ``chain_length``.

    torch's ``_add_unshard_reshard`` and ``_add_reduce_grad`` per rank, then sends and receives
    placed as torch's ``_add_send_recv`` places them (ranks advance in lock step, an action waits
    for its input, a receive is posted when its send is issued), except that no transfer crosses a
    chain's end; then torch's waits for the sends (2.15).

    Args:
        order: per rank, its compute actions (None: an idle slot).
        stage_to_rank: the rank of every stage.
        chain_length: stages per chain; stage s is in chain s // ``chain_length``.
        units_per_stage: the units each stage runs in a step (its last backward reduces gradients).

    Returns:
        Per rank, its actions with FSDP's, the sends' and the receives'.

    Raises:
        ValueError: where no order of sends and receives runs the lists (they deadlock).
    """
    pending = {
        r: [a for a in add_reduce_grad(add_unshard_reshard(acts), units_per_stage) if a is not None]
        for r, acts in order.items()
    }
    lowered: dict[int, list[Action]] = {r: [] for r in order}
    seen: dict[int, set[Action]] = {r: set() for r in order}

    def post(r: int, a: Action) -> None:
        lowered[r].append(a)
        seen[r].add(a)

    def ready(a: Action, r: int) -> bool:
        s, u, n = a.stage_index, a.microbatch_index, fed_by(a, chain_length)
        sources = ((s, RECV_F), (n, F)) if a.computation_type == F else ((s, RECV_B), (n, B), (n, I))
        return n is None or any(Action(stage, kind, u) in seen[r] for stage, kind in sources)

    while any(pending.values()):
        progress = False
        for r in sorted(pending):
            if not pending[r] or not ready(pending[r][0], r):
                continue
            post(r, a := pending[r].pop(0))
            s, u, n = a.stage_index, a.microbatch_index, feeds(a, chain_length)
            if n is not None and stage_to_rank[n] != stage_to_rank[s]:
                send, recv = (SEND_F, RECV_F) if a.computation_type == F else (SEND_B, RECV_B)
                post(r, Action(s, send, u))
                post(stage_to_rank[n], Action(n, recv, u))
            progress = True
        if not progress:
            stuck = {r: str(acts[0]) for r, acts in pending.items() if acts}
            raise ValueError(f"no order of sends and receives runs these lists: ranks stuck at {stuck}")
    return add_send_waits(lowered)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


STEP_COUNTERS: tuple[str, ...] = ("tokens_per_expert", "tokens_per_expert_E")
"""Names of buffers that count what a step's forwards see: torchtitan's MoE layers count the tokens routed
to each expert (0.2.2's name, 0.3's), which its load balancing reads after the step."""


class MirroredCopies:
    """The two copies of this rank's model chunks and of its mirror's, kept identical.

    Chain A's copy of a chunk is the primary: after a step :meth:`combine_gradients` adds the mirror
    copy's gradient to it and drops the mirror copy's, so the optimizer steps each chunk once and
    gradient-norm clipping counts it once, and moves the mirror's step counters
    (:data:`STEP_COUNTERS`) onto the primary's, so they count the whole step's tokens;
    :meth:`sync_parameters` then copies the primaries' new values and persistent buffers (an MoE's
    expert bias, which torchtitan's optimizer hook updates) over the mirror copies. Each is one
    all-reduce per pair, on one flat buffer in the order both ranks share: by chunk index.
    Constructing it is a collective over the world: every process
    creates every pair's process group.

    Args:
        modules: {stage index: module} of this rank's stages.
        layout: where the two chains' stages live.
        pp_group: the pipeline's process group (its group ranks are the layout's ranks).
    """

    def __init__(self, modules: dict[int, nn.Module], layout: BidirectionalLayout, pp_group: dist.ProcessGroup) -> None:
        self._chunks = [(modules[s], s < layout.chain_length) for s in sorted(modules, key=layout.chunk)]
        # new_group must be called by every process for every group: gather the pipelines of all
        # data- and tensor-parallel coordinates first.
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dist.get_process_group_ranks(pp_group))
        mirrors = [(r, layout.mirror(r)) for r in range(layout.num_positions)]
        pairs = sorted({tuple(sorted((ranks[r], ranks[m]))) for ranks in everyone for r, m in mirrors})
        groups = {pair: dist.new_group(list(pair)) for pair in pairs}
        self._group = next((g for pair, g in groups.items() if dist.get_rank() in pair), None)

    def _parameter_pairs(self) -> list[tuple[nn.Parameter, bool]]:
        """(parameter, is a primary) in the pair's common order."""
        # Read at each use: torchtitan materialises meta parameters after the schedule is built.
        return [(p, primary) for module, primary in self._chunks for p in module.parameters()]

    def _counters(self) -> list[tuple[torch.Tensor, bool]]:
        """(step counter, is a primary) in the pair's common order."""
        return [
            (b, primary)
            for module, primary in self._chunks
            for name, b in module.named_buffers()
            if name.rsplit(".", 1)[-1] in STEP_COUNTERS
        ]

    def _state_buffers(self) -> list[tuple[torch.Tensor, bool]]:
        """(persistent buffer, is a primary) in the pair's common order, but the step counters."""
        return [
            (b, primary)
            for module, primary in self._chunks
            for name, b in persistent_buffers(module)
            if name not in STEP_COUNTERS
        ]

    def _pair_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` summed over the pair, as one flat all-reduce."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self._group)
        return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    @torch.no_grad()
    def combine_gradients(self) -> None:
        """Primary grad <- primary + mirror grad (over the pair); mirror grads -> None."""
        params = self._parameter_pairs()
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p, _ in params]
        for (p, primary), total in zip(params, self._pair_sum(grads)):
            if not primary:
                p.grad = None
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _local(p.grad).copy_(total)
        self._move_counters()

    def _move_counters(self) -> None:
        """Primary counters <- primary + mirror counters (over the pair); mirror counters <- 0."""
        counters = self._counters()
        for (b, primary), total in zip(counters, self._pair_sum([b for b, _ in counters]) if counters else []):
            b.copy_(total if primary else torch.zeros_like(b))

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """Mirror copies <- primary copies (over the pair)."""
        params = [(_local(p).detach(), primary) for p, primary in self._parameter_pairs()] + self._state_buffers()
        values = [t if primary else torch.zeros_like(t) for t, primary in params]
        for (t, primary), total in zip(params, self._pair_sum(values)):
            if not primary:
                t.copy_(total)

    @torch.no_grad()
    def max_difference(self) -> float:
        """Largest |primary - mirror| over this pair's chunks (0.0: the copies are identical)."""
        values = [_local(p).detach() if primary else -_local(p).detach() for p, primary in self._parameter_pairs()]
        return max((float(d.abs().max()) for d in self._pair_sum(values) if d.numel()), default=0.0)


class BidirectionalSchedule(SequenceSchedule):
    """The runtime of a schedule of two pipelines in opposite directions (BSIPipe, Chimera).

    A subclass names its ``stages_per_rank`` (its layout's shape) and its ``actions_fn``. A
    step starts from identical copies and leaves each chunk's whole gradient on its chain-A copy
    (:class:`MirroredCopies`); call :meth:`after_optimizer_step` after each optimizer step (the
    trainer does). ``step()`` returns no outputs: each last stage sees half of the microbatches.

    Args:
        stages: this rank's stages, those the layout puts on it.
        n_microbatches: N, microbatches per step (even: half go down each chain).
        loss_fn: per-unit loss, see the package docstring.
        split_backward: must be False: the two chains run full backwards.
        scale_grads: as :class:`~torchtitan_seq.schedules.base.SequenceSchedule`'s.
        placement: position -> rank, one of :data:`PLACEMENTS`.
    """

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
        placement: Placement = "paired",
    ) -> None:
        self.check_torch()
        self.layout = BidirectionalLayout(stages[0].group_size, placement, self.stages_per_rank)
        held, expected = sorted(s.stage_index for s in stages), self.layout.stages_of_rank(stages[0].group_rank)
        if held != expected:
            raise ValueError(
                f"pipeline rank {stages[0].group_rank} holds stages {held}, but {self._name()}'s "
                f"{placement!r} layout puts {expected} there"
            )
        super().__init__(stages, n_microbatches, loss_fn, split_backward=split_backward, scale_grads=scale_grads)
        self.copies = MirroredCopies({s.stage_index: s.submod for s in self.stages}, self.layout, stages[0].group)
        self._copies_synced = False

    @classmethod
    def _name(cls) -> str:
        return cls.__name__.removeprefix("Schedule")

    def lower(self, order: dict[int, list[Action | None]]) -> None:
        """The lists by position -> by rank, lowered by :func:`lower_chains` (torch's passes cannot
        place sends between two chains)."""
        self.pipeline_order = {self.layout.rank_of_position(q): acts for q, acts in order.items()}
        stage_to_rank = self.layout.stage_to_rank()
        chain = self.layout.chain_length
        self.use_lowered(stage_to_rank, lower_chains(self.pipeline_order, stage_to_rank, chain, self.num_units // 2))

    @classmethod
    def check_torch(cls) -> None:
        """Refuse torch before 2.13, whose pipeline set-up cannot run two chains (the simulator needs no check)."""
        if torch.__version__ < "2.13":
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule = {cls._name()!r} needs torch 2.13 or newer, not "
                f"{torch.__version__}: torch 2.11 infers each stage's shapes from the stage before it on the rank, "
                "which two chains on a rank do not follow; use Seq1F1B, InterleavedSeq1F1B or TeraPipe"
            )

    @classmethod
    def check_shape(cls, shape: ScheduleShape, placement: Placement = "paired") -> None:
        # Without building the lists (BSIPipe's list scheduling is costly at large shapes); the actions
        # functions call it too.
        BidirectionalLayout(shape.num_ranks, placement, cls.stages_per_rank)  # an even p, a known placement
        v = cls.stages_per_rank
        if shape.stages_per_rank not in (None, v):
            raise ValueError(
                f"{cls._name()} holds {v} stages per rank ({v // 2} of each chain), not {shape.stages_per_rank}"
            )
        if shape.split_backward:
            raise ValueError(f"{cls._name()} runs full backwards: set sequence_pipeline.split_backward = false")
        if shape.num_microbatches % 2:
            raise ValueError(
                f"{cls._name()} shares the microbatches between its two pipelines, so it needs an even "
                f"number of them, got {shape.num_microbatches}: change training.local_batch_size or "
                "parallelism.pipeline_parallel_microbatch_size"
            )

    @classmethod
    def options_from_config(cls, config: Any) -> dict[str, Any]:
        return {"placement": config.bidirectional_placement}

    @classmethod
    def place_stages(cls, num_ranks: int, num_chunks: int, placement: Placement = "paired") -> StagePlacement:
        layout = BidirectionalLayout(num_ranks, placement, cls.stages_per_rank)
        if num_chunks != layout.chain_length:
            raise ValueError(
                f"{cls._name()} cuts the model into {layout.chain_length} chunks "
                f"({layout.stages_per_rank // 2} per pipeline rank and direction), got {num_chunks}"
            )
        return [[(s, layout.chunk(s)) for s in layout.stages_of_rank(r)] for r in range(num_ranks)]

    def describe(self) -> str:
        return f"{self._name()} placement '{self.layout.placement}':\n{self.layout.describe()}"

    def after_optimizer_step(self) -> None:
        """Copy each chunk's chain-A values over its chain-B copy."""
        self.copies.sync_parameters()
        self._copies_synced = True

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        if not self._copies_synced:  # the first step: chain B's copies start as chain A's
            self.after_optimizer_step()
        super().step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self.runs_backward:
            self.copies.combine_gradients()
