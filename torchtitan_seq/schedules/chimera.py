"""Chimera: two straight pipelines in opposite directions (Li & Hoefler, SC'21), over units.

Layout, lowering and mirrored copies: :mod:`~torchtitan_seq.schedules.bidirectional`, shared with BSIPipe.
"""

from __future__ import annotations

from torchtitan_seq.runtime.torch_internals import Action
from torchtitan_seq.schedules.base import ActionLists, ScheduleShape
from torchtitan_seq.schedules.bidirectional import BidirectionalSchedule
from torchtitan_seq.schedules.ordering import B, F
from torchtitan_seq.schedules.seq1f1b import unit_orders

__all__ = ["chimera_actions", "ScheduleChimera"]


def chimera_actions(shape: ScheduleShape) -> ActionLists:
    """Chimera: two straight Seq1F1B pipelines in opposite directions (the straight shape of
    :mod:`.bidirectional`), merged as Chimera merges them: each pass takes the slot it has in its own
    chain's 1F1B when forward and backward take one slot each (stage i's n-th forward in slot i + n
    during its warm-up, later ones right after the backward they alternate with; its n-th backward in
    slot 2p - 2 + k - i + 2n), and each position runs its passes in slot order, the deeper stage
    first on a tie. Slots are a valid timing, so the lists cannot deadlock; any even N is one merged
    1F1B.

    Simulated (docs/simulator.md): bubble exactly (p-2)/(2Nk+p-2) for even N >= p when a backward
    takes a forward's time, at most 2(p-2)/(3Nk+2(p-2)) under uniform costs; peak activations per rank
    at most ((p-1)/k + 2) M whatever N.
    """
    ScheduleChimera.check_shape(shape)
    p, k = shape.num_ranks, shape.num_subsequences
    slotted: dict[int, list[tuple[int, int, Action]]] = {q: [] for q in range(p)}
    for chain in (0, 1):
        fwd, bwd = unit_orders(range(chain, shape.num_microbatches, 2), k)
        for i in range(p):  # depth in the chain
            stage, q = chain * p + i, (i if chain == 0 else p - 1 - i)
            warmup = k + p - 1 - i
            slotted[q] += [
                (i + n if n < warmup else i + 1 - k + 2 * n, -i, Action(stage, F, u)) for n, u in enumerate(fwd)
            ]
            slotted[q] += [(2 * p - 2 + k - i + 2 * n, -i, Action(stage, B, u)) for n, u in enumerate(bwd)]
    return {q: [a for *_, a in sorted(passes, key=lambda x: x[:2])] for q, passes in slotted.items()}


class ScheduleChimera(BidirectionalSchedule):
    """Chimera; see :func:`chimera_actions` and, for the layout, :mod:`.bidirectional`."""

    actions_fn = staticmethod(chimera_actions)
    stages_per_rank = 2  # the straight shape of .bidirectional
