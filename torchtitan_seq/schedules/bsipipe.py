"""BSIPipe: two V-shaped pipelines in opposite directions over units (Ni & Chen, 2026).

The action lists come from list scheduling of a basic unit of 2p
microbatches (:func:`bsipipe_actions`); the layout of the two chains, their
lowering and the mirrored parameter copies are
:mod:`~torchtitan_seq.schedules.bidirectional`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining.schedules import _Action

from ..ordering import B, F, chain_neighbour, fed_by
from ._common import ActionLists, unit_orders
from .bidirectional import SHAPES, BidirectionalLayout, BidirectionalSchedule, check_bidirectional_shape

__all__ = ["bsipipe_actions", "ScheduleBSIPipe"]

_BSIPIPE_PRIORITIES = (
    (0.054, -0.249, -0.969, 0.466, 0.653),
    (0.282, -0.09, -0.819, 0.619, 1.08),
    (0.44, 0.63, -0.946, 0.056, 1.936),
    (0.116, 1.888, -0.523, 0.409, -0.229),
    (0.345, 1.655, -0.92, -0.521, 1.964),
)
"""Weights of BSIPipe's list-scheduling priorities (see :func:`_list_schedule`),
found by a random search over uniform-cost simulations (p 4 and 8, k 1-4,
N 2p and 8p); no single one is best for every shape."""


@dataclass
class _ListSchedule:
    actions: ActionLists
    makespan: float
    in_flight: list[list[int]]
    """Per position: the most units of chain A, of chain B and of both held at
    once (a unit on one chunk counts one)."""

    @property
    def peak(self) -> int:
        return max(most[2] for most in self.in_flight)


def _list_schedule(
    num_ranks: int, num_microbatches: int, k: int, weights: tuple[float, ...], limits: list[list[int]]
) -> _ListSchedule:
    """One BSIPipe list schedule under uniform costs (a chunk's forward 1/2k, its backward 1/k).

    Whenever a position can start something, it runs the pass with the lowest
    priority among those whose inputs exist: weights . (is a forward, passes it
    ran on that chain / 10, +-depth in the chain / 10 (+ for forwards),
    microbatch / 10, time it spent on that chain). A forward waits while the
    position holds ``limits[q][chain]`` units of that chain or ``limits[q][2]``
    in all; if no position can start anything under the limits, they grow by one.
    """
    p, chain = num_ranks, 2 * num_ranks
    layout = BidirectionalLayout(p, placement="linear")
    fwd: dict[int, list[int]] = {}
    bwd: dict[int, list[int]] = {}
    for c in (0, 1):
        f, b = unit_orders(range(c, num_microbatches, 2), k)
        for s in range(chain):
            fwd[c * chain + s], bwd[c * chain + s] = f[::-1], b[::-1]
    cost = {F: 0.5 / k, B: 1.0 / k}
    finished: dict[tuple[int, Any, int], float] = {}
    free = [0.0] * p
    live = [[0, 0] for _ in range(p)]
    most = [[0, 0, 0] for _ in range(p)]
    ran = [[0, 0] for _ in range(p)]
    busy = [[0.0, 0.0] for _ in range(p)]
    limits = [list(lim) for lim in limits]
    stages = [layout.stages_of_rank(q) for q in range(p)]
    actions: ActionLists = {q: [] for q in range(p)}

    def candidates(q: int) -> list[tuple[float, float, int, Any, int]]:
        out = []
        for s in stages[q]:
            c, depth = divmod(s, chain)
            for kind, queue in ((B, bwd[s]), (F, fwd[s])):
                full = live[q][c] >= limits[q][c] or sum(live[q]) >= limits[q][2]
                if not queue or (kind == F and full):
                    continue
                u = queue[-1]
                upstream = fed_by(_Action(s, kind, u), chain)
                needs = [] if upstream is None else [(upstream, kind, u)]
                if kind == B:  # and, by rule 2, after the microbatch's last forward on the stage
                    needs.append((s, F, u - u % k + k - 1))
                if all(n in finished for n in needs):
                    w = weights
                    priority = (
                        w[0] * (kind == F) + w[1] * ran[q][c] * 0.1
                        + w[2] * depth * (0.1 if kind == F else -0.1) + w[3] * (u // k) * 0.1 + w[4] * busy[q][c]
                    )
                    out.append((max([free[q]] + [finished[n] for n in needs]), priority, s, kind, u))
        return out

    # Each position's candidates change only when it or a neighbour in a chain acts.
    touches = {s: {layout.rank_of_stage(n) for n in (chain_neighbour(s, d, chain) for d in (-1, 0, 1)) if n is not None}
               for s in range(2 * chain)}
    cached = {q: candidates(q) for q in range(p)}
    remaining = 2 * num_microbatches * k * chain
    while remaining:
        # The position that can start soonest acts; nothing it waits for can finish earlier.
        options = [(min(c[0] for c in cands), q, cands) for q, cands in cached.items() if cands]
        if not options:
            limits = [[lim + 1 for lim in lims] for lims in limits]
            cached = {q: candidates(q) for q in range(p)}
            continue
        start, q, cands = min(options, key=lambda o: o[:2])
        _, _, s, kind, u = min((c for c in cands if c[0] <= start), key=lambda c: c[1])
        c = s // chain
        (fwd if kind == F else bwd)[s].pop()
        live[q][c] += 1 if kind == F else -1
        most[q][c] = max(most[q][c], live[q][c])
        most[q][2] = max(most[q][2], sum(live[q]))
        ran[q][c] += 1
        busy[q][c] += cost[kind]
        free[q] = finished[(s, kind, u)] = start + cost[kind]
        actions[q].append(_Action(s, kind, u))
        remaining -= 1
        for r in touches[s]:
            cached[r] = candidates(r)
    return _ListSchedule(actions, max(free), most)


def bsipipe_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False, stages_per_rank: int = 4
) -> ActionLists:
    """BSIPipe: two V-shaped pipelines in opposite directions over units.

    Stages are numbered as :class:`~torchtitan_seq.schedules.bidirectional.BidirectionalLayout`
    numbers them (chain A: 0..2p-1, chain B: 2p..4p-1) and the lists are keyed
    by pipeline position (the schedule maps positions to ranks). Even
    microbatches go down chain A, odd ones down chain B.

    Basic-unit concatenation: a basic unit of 2p microbatches (p each way) is
    list-scheduled under each of :data:`_BSIPIPE_PRIORITIES`, with at most
    3k + 2p units of a chain held on a position, and the shortest one kept.
    The units each position and chain held at most there are the memory
    budget of the whole step: the step is list-scheduled again under each
    priority within that budget, and the shortest that uses all of it is
    kept (else the shortest). So peak activations do not grow with N.

    Full backward only: torch's input/weight split special-cases stage 0,
    which would miss chain B's first stage.
    """
    check_bidirectional_shape("BSIPipe", "v", num_ranks, num_microbatches, split_backward, stages_per_rank)
    p, k = num_ranks, num_subsequences
    limit = [[3 * k + 2 * p] * 2 + [6 * k + 4 * p] for _ in range(p)]
    basic_n = min(num_microbatches, 2 * p)
    basic = min(
        (_list_schedule(p, basic_n, k, w, limit) for w in _BSIPIPE_PRIORITIES), key=lambda r: r.makespan
    )
    if num_microbatches == basic_n:
        return basic.actions
    steps = [_list_schedule(p, num_microbatches, k, w, basic.in_flight) for w in _BSIPIPE_PRIORITIES]
    return min(steps, key=lambda r: (r.peak != basic.peak, r.makespan)).actions


class ScheduleBSIPipe(BidirectionalSchedule):
    """BSIPipe: two V-shaped pipelines in opposite directions over units; see
    :func:`bsipipe_actions`, and :class:`~torchtitan_seq.schedules.bidirectional.BidirectionalSchedule`
    for the runtime (mirrored copies, placement).

    Each rank holds four stages (chunks {q, 2p-1-q} of chain A and
    {p-1-q, p+q} of chain B at position q), built with ``chain_length = 2p``.
    """

    actions_fn = staticmethod(bsipipe_actions)
    layout_shape = "v"
    stages_per_rank = SHAPES[layout_shape]
