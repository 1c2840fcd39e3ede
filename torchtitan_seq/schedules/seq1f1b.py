"""Seq1F1B and TeraPipe: one stage per rank, 1F1B or GPipe over (microbatch, subsequence) units;
and the unit orders and 1F1B pattern every sequence schedule's lists are built from."""

from __future__ import annotations

from collections.abc import Callable

from torchtitan_seq.runtime.torch_internals import Action
from torchtitan_seq.schedules.base import ActionLists, ScheduleShape, SequenceSchedule
from torchtitan_seq.schedules.ordering import B, F, I, W

__all__ = ["unit_orders", "one_f_one_b", "seq1f1b_actions", "terapipe_actions", "ScheduleSeq1F1B", "ScheduleTeraPipe"]


def unit_orders(microbatches: range, k: int) -> tuple[list[int], list[int]]:
    """Units of ``microbatches`` in forward order (subsequence order) and in backward order (last subsequence first)."""
    fwd = [m * k + j for m in microbatches for j in range(k)]
    bwd = [m * k + j for m in microbatches for j in reversed(range(k))]
    return fwd, bwd


def one_f_one_b(
    warmup: int, fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], split_backward: bool
) -> list[Action | None]:
    """One rank's list: ``warmup`` forwards, then alternate backward/forward, then the remaining backwards.

    With ``split_backward`` each backward is an input-gradient pass (I) followed by its
    weight-gradient pass (W), except in the cool-down, where the Ws wait until every I has run: the
    I passes the previous rank is waiting for go first, and the Ws fill what would be idle time at
    the end (the zero-bubble idea), without holding more activations than 1F1B.

    Args:
        warmup: forwards before the rank's first backward.
        fwd: the rank's (stage index, unit id) slots in forward order.
        bwd: the same slots in backward order.
        split_backward: I and W passes instead of B.

    Returns:
        The rank's compute actions in order.
    """
    backward = [I, W] if split_backward else [B]
    actions: list[Action | None] = [Action(s, F, u) for s, u in fwd[:warmup]]
    for (s_f, u_f), (s_b, u_b) in zip(fwd[warmup:], bwd):
        actions += [Action(s_b, kind, u_b) for kind in backward] + [Action(s_f, F, u_f)]
    return actions + [Action(s, kind, u) for kind in backward for s, u in bwd[len(fwd) - warmup :]]


def _one_stage_per_rank(shape: ScheduleShape, warmup: Callable[[int], int]) -> ActionLists:
    """Stage r on rank r, all units in order; ``warmup(r)`` forwards before rank r's first backward."""
    fwd, bwd = unit_orders(range(shape.num_microbatches), shape.num_subsequences)
    return {
        r: one_f_one_b(min(len(fwd), warmup(r)), [(r, u) for u in fwd], [(r, u) for u in bwd], shape.split_backward)
        for r in range(shape.num_ranks)
    }


def seq1f1b_actions(shape: ScheduleShape) -> ActionLists:
    """Seq1F1B (arXiv 2406.03488): 1F1B over units, one stage per rank.

    Rank r warms up with k + p - 1 - r forwards, so the first backward (the last subsequence of
    microbatch 0) arrives just as it is needed. Peak in-flight units on rank 0: min(p - 1 + k, N k).
    """
    p, k = shape.num_ranks, shape.num_subsequences
    return _one_stage_per_rank(shape, lambda r: k + p - 1 - r)


def terapipe_actions(shape: ScheduleShape) -> ActionLists:
    """TeraPipe (ICML'21): GPipe over units, every forward then every backward, last unit first."""
    n = shape.num_microbatches * shape.num_subsequences
    return _one_stage_per_rank(shape, lambda r: n)


class ScheduleSeq1F1B(SequenceSchedule):
    """Seq1F1B: 1F1B over (microbatch, subsequence) units; see :func:`seq1f1b_actions`."""

    actions_fn = staticmethod(seq1f1b_actions)


class ScheduleTeraPipe(SequenceSchedule):
    """TeraPipe: GPipe over units; see :func:`terapipe_actions`."""

    actions_fn = staticmethod(terapipe_actions)
