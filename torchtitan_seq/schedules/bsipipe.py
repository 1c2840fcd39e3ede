"""BSIPipe: two V-shaped pipelines in opposite directions over units (Ni & Chen, 2026).

Action lists by list scheduling (:func:`bsipipe_actions`); layout, lowering and mirrored copies:
:mod:`~torchtitan_seq.schedules.bidirectional`, shared with Chimera.
"""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.pipelining.schedules import _Action

from ..ordering import B, F, chain_neighbour, fed_by
from .base import ActionLists
from .bidirectional import BidirectionalLayout, BidirectionalSchedule
from .seq1f1b import unit_orders

__all__ = ["bsipipe_actions", "ScheduleBSIPipe"]

_BSIPIPE_PRIORITIES = (
    (0.054, -0.249, -0.969, 0.466, 0.653),
    (0.282, -0.09, -0.819, 0.619, 1.08),
    (0.44, 0.63, -0.946, 0.056, 1.936),
    (0.116, 1.888, -0.523, 0.409, -0.229),
    (0.345, 1.655, -0.92, -0.521, 1.964),
)
"""Weights of the list-scheduling priorities (:func:`_list_schedule`), from a random search over
uniform-cost simulations (p 4 and 8, k 1-4, N 2p and 8p); no single one is best for every shape."""


def _list_schedule(
    num_ranks: int, num_microbatches: int, k: int, weights: tuple[float, ...], limits: list[list[int]]
) -> tuple[ActionLists, float, list[list[int]]]:
    """One BSIPipe list schedule under uniform costs (a chunk's forward 1/2k, its backward 1/k): its lists,
    its makespan and, per position, the most units of chain A, of chain B and of both it held at once.

    Whenever a position can start something, it runs the pass with the lowest priority among those
    whose inputs exist: weights . (is a forward, passes it ran on that chain / 10, +-depth in the
    chain / 10 (+ for forwards), microbatch / 10, time it spent on that chain). A forward waits
    while the position holds ``limits[q][chain]`` units of that chain or ``limits[q][2]`` in all; if
    no position can start anything under the limits, they grow by one.
    """
    p, chain = num_ranks, 2 * num_ranks
    layout = BidirectionalLayout(p, placement="linear")
    orders = [unit_orders(range(c, num_microbatches, 2), k) for c in (0, 1)]
    # Per (stage, kind), the units still to run, next one last.
    queue = {(s, kind): units[::-1] for s in range(2 * chain) for kind, units in zip((F, B), orders[s // chain])}
    cost = {F: 0.5 / k, B: 1.0 / k}
    finished: dict[tuple[int, Any, int], float] = {}
    free = [0.0] * p
    live = [[0, 0] for _ in range(p)]
    most = [[0, 0, 0] for _ in range(p)]
    ran = [[0, 0] for _ in range(p)]
    busy = [[0.0, 0.0] for _ in range(p)]
    stages = [layout.stages_of_rank(q) for q in range(p)]
    upstream = {(s, kind): fed_by(_Action(s, kind, 0), chain) for s in range(2 * chain) for kind in (F, B)}
    actions: ActionLists = {q: [] for q in range(p)}

    def candidates(q: int) -> tuple[float, list[tuple[float, int, Any, int]]]:
        """(soonest start, (start, stage, kind, unit) of the passes ``q`` can start) of position ``q``."""
        out = []
        full_at = live[q][0] + live[q][1] >= limits[q][2]
        for s in stages[q]:
            c = s // chain
            full = full_at or live[q][c] >= limits[q][c]
            for kind in (B, F):
                waiting = queue[s, kind]
                if not waiting or (kind == F and full):
                    continue
                u, up = waiting[-1], upstream[s, kind]
                made = free[q] if up is None else finished.get((up, kind, u))
                # A backward also waits, by rule 2, for the microbatch's last forward on the stage.
                forwarded = free[q] if kind == F else finished.get((s, F, u - u % k + k - 1))
                if made is not None and forwarded is not None:
                    out.append((max(free[q], made, forwarded), s, kind, u))
        return min((o[0] for o in out), default=math.inf), out

    def priority(q: int, s: int, kind: Any, u: int) -> float:
        c, depth = divmod(s, chain)
        w = weights
        return (
            w[0] * (kind == F) + w[1] * ran[q][c] * 0.1
            + w[2] * depth * (0.1 if kind == F else -0.1) + w[3] * (u // k) * 0.1 + w[4] * busy[q][c]
        )

    # Each position's candidates change only when it or a neighbour in a chain acts.
    touches = {s: {layout.rank_of_stage(n) for n in (chain_neighbour(s, d, chain) for d in (-1, 0, 1)) if n is not None}
               for s in range(2 * chain)}
    cached = [candidates(q) for q in range(p)]
    soonest = [c[0] for c in cached]
    remaining = 2 * num_microbatches * k * chain
    while remaining:
        # The position that can start soonest (the first of equals) acts; nothing it waits for can finish earlier.
        start = min(soonest)
        q = soonest.index(start)
        if start == math.inf:
            limits = [[lim + 1 for lim in lims] for lims in limits]
            cached = [candidates(q) for q in range(p)]
            soonest = [c[0] for c in cached]
            continue
        cands = cached[q][1]
        _, s, kind, u = min((c for c in cands if c[0] <= start), key=lambda c: priority(q, *c[1:]))
        c = s // chain
        queue[s, kind].pop()
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
            soonest[r] = cached[r][0]
    return actions, max(free), most


def bsipipe_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False, stages_per_rank: int = 4
) -> ActionLists:
    """BSIPipe: two V-shaped pipelines in opposite directions (the V shape of :mod:`.bidirectional`).

    Basic-unit concatenation: a basic unit of 2p microbatches (p each way) is list-scheduled under
    each of :data:`_BSIPIPE_PRIORITIES`, with at most 3k + 2p units of a chain held on a position,
    and the shortest one kept. The units each position and chain held at most there are the memory
    budget of the whole step: the step is list-scheduled again under each priority within that
    budget, and the shortest that uses all of it is kept (else the shortest). So peak activations do
    not grow with N.
    """
    ScheduleBSIPipe.check_shape(
        num_ranks, num_microbatches, num_subsequences, split_backward=split_backward, stages_per_rank=stages_per_rank
    )
    p, k = num_ranks, num_subsequences
    limit = [[3 * k + 2 * p] * 2 + [6 * k + 4 * p] for _ in range(p)]
    basic_n = min(num_microbatches, 2 * p)
    basics = [_list_schedule(p, basic_n, k, w, limit) for w in _BSIPIPE_PRIORITIES]
    basic, _, in_flight = min(basics, key=lambda r: r[1])
    if num_microbatches == basic_n:
        return basic
    peak = max(most[2] for most in in_flight)
    steps = [_list_schedule(p, num_microbatches, k, w, in_flight) for w in _BSIPIPE_PRIORITIES]
    return min(steps, key=lambda r: (max(most[2] for most in r[2]) != peak, r[1]))[0]


class ScheduleBSIPipe(BidirectionalSchedule):
    """BSIPipe; see :func:`bsipipe_actions` and, for the layout, :mod:`.bidirectional`."""

    actions_fn = staticmethod(bsipipe_actions)
    stages_per_rank = 4  # the V shape of .bidirectional
