"""What every sequence schedule's action lists are built from: unit orders and the 1F1B pattern."""

from __future__ import annotations

from typing import Callable

from torch.distributed.pipelining.schedules import _Action

from ..ordering import B, F, I, W

__all__ = ["ActionLists", "Slot", "unit_orders", "one_f_one_b", "single_stage"]

ActionLists = dict[int, list[_Action | None]]


Slot = tuple[int, int]
"""(stage index, unit id): one unit on one stage."""


def unit_orders(microbatches: range, k: int) -> tuple[list[int], list[int]]:
    """Units of ``microbatches`` in forward order (subsequence order) and in backward
    order (last subsequence first)."""
    fwd = [m * k + j for m in microbatches for j in range(k)]
    bwd = [m * k + j for m in microbatches for j in reversed(range(k))]
    return fwd, bwd


def one_f_one_b(warmup: int, fwd: list[Slot], bwd: list[Slot], split_backward: bool) -> list[_Action | None]:
    """One rank's list: ``warmup`` forwards, then alternate backward/forward, then the remaining backwards.

    ``fwd`` and ``bwd`` are the rank's slots in the order they run forward and
    backward. With ``split_backward`` each backward is an input-gradient pass
    (I) followed by its weight-gradient pass (W), except in the cool-down,
    where the Ws wait until every I has run: the I passes the previous rank is
    waiting for go first, and the Ws fill what would be idle time at the end
    (the zero-bubble idea), without holding more activations than 1F1B.
    """
    back = I if split_backward else B
    actions: list[_Action | None] = [_Action(s, F, u) for s, u in fwd[:warmup]]
    for (s_f, u_f), (s_b, u_b) in zip(fwd[warmup:], bwd):
        actions.append(_Action(s_b, back, u_b))
        if split_backward:
            actions.append(_Action(s_b, W, u_b))
        actions.append(_Action(s_f, F, u_f))
    cooldown = bwd[len(fwd) - warmup:]
    actions += [_Action(s, back, u) for s, u in cooldown]
    if split_backward:
        actions += [_Action(s, W, u) for s, u in cooldown]
    return actions


def single_stage(
    num_ranks: int, num_microbatches: int, k: int, warmup: Callable[[int], int], split_backward: bool
) -> ActionLists:
    """Stage r on rank r, all units in order; ``warmup(r)`` forwards before rank r's first backward."""
    fwd, bwd = unit_orders(range(num_microbatches), k)
    actions: ActionLists = {}
    for r in range(num_ranks):
        slots = [(r, u) for u in fwd], [(r, u) for u in bwd]
        actions[r] = one_f_one_b(min(len(fwd), warmup(r)), *slots, split_backward)
    return actions


