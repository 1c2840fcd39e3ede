"""BSIPipe: two V-shaped pipelines in opposite directions over units (Ni & Chen, 2026).

Action lists by list scheduling (:func:`bsipipe_actions`); layout, lowering and mirrored copies:
:mod:`~torchtitan_seq.schedules.bidirectional`, shared with Chimera.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from torchtitan_seq.runtime.torch_internals import Action
from torchtitan_seq.schedules.base import ActionLists, ScheduleShape
from torchtitan_seq.schedules.bidirectional import BidirectionalLayout, BidirectionalSchedule
from torchtitan_seq.schedules.ordering import B, F, fed_by, feeds
from torchtitan_seq.schedules.seq1f1b import unit_orders

__all__ = ["Priority", "PRIORITIES", "ListSchedule", "list_schedule", "bsipipe_actions", "ScheduleBSIPipe"]


@dataclass(frozen=True)
class Priority:
    """How a position ranks the passes it can start: the one with the lowest weighted sum of these
    features runs. The counts are divided by 10, as they were in the random search that found the
    weights (:data:`PRIORITIES`), which puts them on the scale of the time feature (a chunk's
    forward costs 1/2k, its backward 1/k)."""

    forward: float
    """Weight of "is a forward" (1, else 0): positive favours backwards, which free memory."""
    progress: float
    """Weight of the passes the position has run on the pass's chain / 10: positive favours the
    chain it has advanced less."""
    depth: float
    """Weight of the stage's depth in its chain / 10, counted + for a forward and - for a backward:
    negative favours deep forwards and backwards near the chain's start."""
    microbatch: float
    """Weight of the unit's microbatch / 10: positive favours older microbatches."""
    chain_time: float
    """Weight of the time the position has spent on the pass's chain: positive favours the chain
    it has served less."""

    def __call__(self, is_forward: bool, progress: int, depth: int, microbatch: int, chain_time: float) -> float:
        # One expression, in this order: ties between passes are decided by exact float sums.
        return (
            self.forward * is_forward
            + self.progress * progress * 0.1
            + self.depth * depth * (0.1 if is_forward else -0.1)
            + self.microbatch * microbatch * 0.1
            + self.chain_time * chain_time
        )


PRIORITIES = (
    Priority(0.054, -0.249, -0.969, 0.466, 0.653),
    Priority(0.282, -0.09, -0.819, 0.619, 1.08),
    Priority(0.44, 0.63, -0.946, 0.056, 1.936),
    Priority(0.116, 1.888, -0.523, 0.409, -0.229),
    Priority(0.345, 1.655, -0.92, -0.521, 1.964),
)
"""The priorities a step is list-scheduled under, the shortest schedule kept. They come from a random
search over the weights, each schedule simulated under uniform costs (p 4 and 8, k 1-4, N 2p and 8p):
these five together gave the shortest schedules, and no single one is best for every shape."""


@dataclass
class _Position:
    """One position's state while a step is list-scheduled; per-chain lists are indexed [A, B]."""

    stages: list[int]
    limits: list[int]
    """Units of chain A, of chain B and of both it may hold before a forward must wait."""
    free: float = 0.0
    """When its latest pass ends."""
    held: list[int] = field(default_factory=lambda: [0, 0])
    """Units it holds per chain: forward run, backward not yet."""
    most: list[int] = field(default_factory=lambda: [0, 0, 0])
    """The most units it held: of A, of B, of both at once."""
    ran: list[int] = field(default_factory=lambda: [0, 0])
    """Passes it ran per chain."""
    busy: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Time it spent per chain."""

    def full(self, chain: int) -> bool:
        """Whether a forward of ``chain`` must wait for a backward to free a unit."""
        return self.held[chain] >= self.limits[chain] or sum(self.held) >= self.limits[2]


_FORWARD, _BACKWARD = 0, 1
_KINDS = (F, B)
"""Pass kinds as list indices (state in nested lists is quicker to read than in dicts keyed by
(stage, kind, unit) tuples): _KINDS[_FORWARD] is F."""


class ListSchedule(NamedTuple):
    """A list-scheduled step under uniform costs."""

    actions: ActionLists
    makespan: float
    most_held: list[list[int]]
    """Per position, the most units of chain A, of chain B and of both it held at once."""


class _ListScheduler:
    """BSIPipe's list scheduling of one step (:func:`list_schedule`). Per-stage state is
    indexed [stage][kind] with kinds _FORWARD and _BACKWARD."""

    def __init__(
        self, num_ranks: int, num_microbatches: int, k: int, priority: Priority, limits: list[list[int]]
    ) -> None:
        p, self.chain, self.k, self.priority = num_ranks, 2 * num_ranks, k, priority
        layout = BidirectionalLayout(p, placement="linear")
        self.positions = [_Position(layout.stages_of_rank(q), list(limits[q])) for q in range(p)]
        orders = [unit_orders(range(c, num_microbatches, 2), k) for c in (0, 1)]
        stages = range(2 * self.chain)
        # The units still to run, next one last.
        self.queue = [[units[::-1] for units in orders[s // self.chain]] for s in stages]
        self.upstream = [[fed_by(Action(s, kind, 0), self.chain) for kind in _KINDS] for s in stages]
        self.downstream = [[feeds(Action(s, kind, 0), self.chain) for kind in _KINDS] for s in stages]
        # A pass changes what its own position can start and, through the input it makes, what the
        # position of the stage downstream can (see _run): no other position's soonest start moves.
        self.touches = [
            [{layout.rank_of_stage(n) for n in (s, self.downstream[s][kind]) if n is not None} for kind in range(2)]
            for s in stages
        ]
        self.cost = (0.5 / k, 1.0 / k)
        # When each unit's pass ended, None before it ran.
        self.finished: list[list[list[float | None]]] = [
            [[None] * (num_microbatches * k) for _ in _KINDS] for _ in stages
        ]
        # When the inputs of each queue's next unit exist, None before they do or once it is empty;
        # kept up to date by _run, so a position's passes are re-read without recomputing them.
        self.ready = [[self._ready(s, kind) for kind in (_FORWARD, _BACKWARD)] for s in stages]

    def _ready(self, s: int, kind: int) -> float | None:
        """When the inputs of stage ``s``'s next pass of ``kind`` exist (-inf: it has none to wait for)."""
        waiting = self.queue[s][kind]
        if not waiting:
            return None
        u, up = waiting[-1], self.upstream[s][kind]
        made = -math.inf if up is None else self.finished[up][kind][u]
        if kind == _FORWARD or made is None:
            return made
        # A backward also waits, by rule 2, for the microbatch's last forward on the stage.
        forwarded = self.finished[s][_FORWARD][u - u % self.k + self.k - 1]
        return None if forwarded is None else max(made, forwarded)

    def soonest(self, q: int) -> float:
        """When position ``q`` can start its soonest pass (inf: none): once it is free and the pass's
        inputs exist, a forward only while the position holds less than its limits."""
        pos, inputs = self.positions[q], math.inf
        for s in pos.stages:
            ready = self.ready[s]
            if ready[_BACKWARD] is not None and ready[_BACKWARD] < inputs:
                inputs = ready[_BACKWARD]
            if ready[_FORWARD] is not None and ready[_FORWARD] < inputs and not pos.full(s // self.chain):
                inputs = ready[_FORWARD]
        return max(pos.free, inputs)

    def choose(self, q: int, start: float) -> tuple[int, int]:
        """The (stage, kind) position ``q`` runs at ``start``, its soonest start: of the passes it can
        start then, the one of lowest priority (the first of equals, stages ascending, each stage's
        backward before its forward)."""
        pos, best, lowest = self.positions[q], (-1, -1), math.inf
        for s in pos.stages:
            c, depth = divmod(s, self.chain)
            for kind in (_BACKWARD, _FORWARD):
                ready = self.ready[s][kind]
                if ready is None or ready > start or (kind == _FORWARD and pos.full(c)):
                    continue
                unit = self.queue[s][kind][-1]
                value = self.priority(kind == _FORWARD, pos.ran[c], depth, unit // self.k, pos.busy[c])
                if value < lowest:
                    best, lowest = (s, kind), value
        return best

    def _run(self, q: int, stage: int, kind: int) -> int:
        """Position ``q`` runs ``stage``'s next pass of ``kind`` as soon as it can; returns its unit."""
        pos, c = self.positions[q], stage // self.chain
        start = max(pos.free, self.ready[stage][kind])
        unit = self.queue[stage][kind].pop()
        pos.held[c] += 1 if kind == _FORWARD else -1
        pos.most[c] = max(pos.most[c], pos.held[c])
        pos.most[2] = max(pos.most[2], sum(pos.held))
        pos.ran[c] += 1
        pos.busy[c] += self.cost[kind]
        pos.free = self.finished[stage][kind][unit] = start + self.cost[kind]
        # What this pass finishing can make ready: the queue's next unit, the unit downstream and,
        # after a forward, the stage's backward (rule 2).
        for s, changed in ((stage, kind), (self.downstream[stage][kind], kind), (stage, _BACKWARD)):
            if s is not None:
                self.ready[s][changed] = self._ready(s, changed)
        return unit

    def schedule(self) -> ListSchedule:
        """Whenever a position can start something, it runs the startable pass of lowest priority. The
        position that can start soonest (the first of equals) acts: nothing it waits for can finish
        earlier. If no position can start anything under its limits, every limit grows by one."""
        actions: ActionLists = {q: [] for q in range(len(self.positions))}
        soonest = [self.soonest(q) for q in actions]
        for _ in range(sum(len(units) for queues in self.queue for units in queues)):  # every pass once
            while (start := min(soonest)) == math.inf:
                for pos in self.positions:
                    pos.limits = [lim + 1 for lim in pos.limits]
                soonest = [self.soonest(q) for q in actions]
            q = soonest.index(start)
            stage, kind = self.choose(q, start)
            actions[q].append(Action(stage, _KINDS[kind], self._run(q, stage, kind)))
            for r in self.touches[stage][kind]:
                soonest[r] = self.soonest(r)
        return ListSchedule(actions, max(pos.free for pos in self.positions), [pos.most for pos in self.positions])


def list_schedule(
    num_ranks: int, num_microbatches: int, k: int, priority: Priority, limits: list[list[int]]
) -> ListSchedule:
    """One BSIPipe list schedule of a step under uniform costs (a chunk's forward 1/2k, its backward
    1/k); limits grow by one whenever nothing could start otherwise.

    Args:
        num_ranks: p, pipeline positions.
        num_microbatches: N, microbatches of the step (even ones down chain A, odd ones down B).
        k: subsequences per microbatch.
        priority: how a position ranks the passes it can start.
        limits: per position q, the units it may hold (of chain A, of B, of both) before a forward waits.

    Returns:
        The lists by position, their makespan and the most units each position held.
    """
    return _ListScheduler(num_ranks, num_microbatches, k, priority, limits).schedule()


def bsipipe_actions(shape: ScheduleShape) -> ActionLists:
    """BSIPipe: two V-shaped pipelines in opposite directions (the V shape of :mod:`.bidirectional`).

    Basic-unit concatenation: a basic unit of 2p microbatches (p each way) is list-scheduled under
    each of :data:`PRIORITIES`, with at most 3k + 2p units of a chain held on a position,
    and the shortest one kept. The units each position and chain held at most there are the memory
    budget of the whole step: the step is list-scheduled again under each priority within that
    budget, and the shortest that uses all of it is kept (else the shortest). So peak activations do
    not grow with N.
    """
    ScheduleBSIPipe.check_shape(shape)
    p, n, k = shape.num_ranks, shape.num_microbatches, shape.num_subsequences
    limit = [[3 * k + 2 * p] * 2 + [6 * k + 4 * p] for _ in range(p)]
    basic_n = min(n, 2 * p)
    basic = min((list_schedule(p, basic_n, k, w, limit) for w in PRIORITIES), key=lambda r: r.makespan)
    if n == basic_n:
        return basic.actions
    peak = max(most[2] for most in basic.most_held)
    steps = [list_schedule(p, n, k, w, basic.most_held) for w in PRIORITIES]
    return min(steps, key=lambda r: (max(most[2] for most in r.most_held) != peak, r.makespan)).actions


class ScheduleBSIPipe(BidirectionalSchedule):
    """BSIPipe; see :func:`bsipipe_actions` and, for the layout, :mod:`.bidirectional`."""

    actions_fn = staticmethod(bsipipe_actions)
    stages_per_rank = 4  # the V shape of .bidirectional
