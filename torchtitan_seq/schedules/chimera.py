"""Chimera: two straight pipelines in opposite directions (Li & Hoefler, SC'21), over units.

The model is cut into p chunks; chain A runs them down the ranks (stage i on
position i), chain B up (stage i on position p - 1 - i), so each rank holds
two stages and every chunk is held twice, once on each rank of a mirrored
pair. The layout, the lowering and the mirrored parameter copies are
:mod:`~torchtitan_seq.schedules.bidirectional`'s, shared with BSIPipe.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import _Action

from ..ordering import B, F
from ._common import ActionLists, unit_orders
from .bidirectional import SHAPES, BidirectionalSchedule, check_bidirectional_shape

__all__ = ["chimera_actions", "ScheduleChimera"]


def chimera_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False, stages_per_rank: int = 2
) -> ActionLists:
    """Chimera: two straight 1F1B pipelines in opposite directions over units.

    Stages are numbered as :class:`~torchtitan_seq.schedules.bidirectional.BidirectionalLayout`
    numbers the ``straight`` shape (chain A: 0..p-1, chain B: p..2p-1) and the
    lists are keyed by pipeline position (the schedule maps positions to
    ranks). Even microbatches go down chain A, odd ones down chain B; each
    chain runs Seq1F1B over its units (unit id m k + j; stage i warms up with
    k + p - 1 - i forwards, backwards last subsequence first).

    The two chains are merged as Chimera merges them: each pass gets the slot
    it takes in its own chain's 1F1B when a unit's forward and backward both
    take one slot (stage i's n-th forward in slot i + n during its warm-up,
    later ones right after the backward they alternate with; its n-th
    backward in slot 2p - 2 + k - i + 2n), and each position runs its passes
    in slot order, the stage deeper in its chain first where the two chains
    want the same slot. Slots are a valid timing (a pass's inputs come from
    earlier slots), so the lists cannot deadlock. No basic units are
    concatenated: any even N is one merged 1F1B.

    Bubble, simulated (tests/unit/test_chimera_schedule.py): when a backward
    takes a forward's time, exactly (p-2)/(2Nk+p-2) for every even N >= p,
    the paper's (D-2)/(2N+D-2) at k = 1; under uniform costs (backward 2x
    forward) the p-2 idle slots are backward-sized: at most
    2(p-2)/(3Nk+2(p-2)) for N >= p, exactly that at k = 1 and N a multiple
    of p, so the paper's figure is out of reach there (at p = 4, N = 4,
    k = 1 no list does better than 2(p-2)/(3N+2(p-2)) = 0.25 > 0.2). N < p
    leaves each chain too few microbatches to fill it, as in 1F1B. Peak
    activations per rank at most ((p-1)/k + 2) M whatever N (p M at k = 1,
    N = p).

    Full backward only: torch's input/weight split special-cases stage 0,
    which would miss chain B's first stage.
    """
    check_bidirectional_shape("Chimera", "straight", num_ranks, num_microbatches, split_backward, stages_per_rank)
    p, k = num_ranks, num_subsequences
    slotted: dict[int, list[tuple[int, int, _Action]]] = {q: [] for q in range(p)}
    for chain in (0, 1):
        fwd, bwd = unit_orders(range(chain, num_microbatches, 2), k)
        for i in range(p):  # depth in the chain
            stage, q = chain * p + i, (i if chain == 0 else p - 1 - i)
            warmup = k + p - 1 - i
            slotted[q] += [(i + n if n < warmup else i + 1 - k + 2 * n, -i, _Action(stage, F, u))
                           for n, u in enumerate(fwd)]
            slotted[q] += [(2 * p - 2 + k - i + 2 * n, -i, _Action(stage, B, u)) for n, u in enumerate(bwd)]
    return {q: [a for *_, a in sorted(passes, key=lambda x: x[:2])] for q, passes in slotted.items()}


class ScheduleChimera(BidirectionalSchedule):
    """Chimera: two straight pipelines in opposite directions over units; see
    :func:`chimera_actions`, and :class:`~torchtitan_seq.schedules.bidirectional.BidirectionalSchedule`
    for the runtime (mirrored copies, placement).

    Each rank holds two stages (chunk q of chain A and chunk p-1-q of chain B
    at position q), built with ``chain_length = p``: twice the parameters of a
    one-stage schedule, each chunk's gradient combined over its mirrored pair.
    """

    actions_fn = staticmethod(chimera_actions)
    layout_shape = "straight"
    stages_per_rank = SHAPES[layout_shape]
