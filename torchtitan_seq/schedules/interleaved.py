"""Seq1F1B-I: interleaved 1F1B over units, v model chunks per rank in loop placement."""

from __future__ import annotations

from ._common import ActionLists, one_f_one_b, unit_orders
from .base import SequenceSchedule

__all__ = ["interleaved_seq1f1b_actions", "ScheduleInterleavedSeq1F1B"]


def _rounds(num_ranks: int, num_microbatches: int, k: int) -> list[range]:
    """The microbatches of each round of the interleaved schedule.

    Rounds hold p microbatches. A remainder of N mod p microbatches is a
    final, shorter round when it holds at least p units, enough to keep
    the pipeline busy while the ranks pass a round's units down their chunks;
    a smaller one would stall the pipeline (for k = 1 it can even deadlock
    torch's send/recv lowering), so it is spread over the earlier rounds, one
    extra microbatch each, first rounds first (torch's Interleaved1F1B likewise
    makes N // p rounds, but only when they come out equal). The first round is
    always the largest: the warm-up is sized by it.
    """
    p, n = num_ranks, num_microbatches
    full, rest = divmod(n, p)
    if full == 0 or rest * k >= p:
        sizes = [p] * full + ([rest] if rest else [])
    else:
        sizes = [n // full + (i < n % full) for i in range(full)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(s, s + size) for s, size in zip(starts, sizes)]


def interleaved_seq1f1b_actions(
    num_ranks: int,
    num_microbatches: int,
    num_subsequences: int,
    *,
    split_backward: bool = False,
    stages_per_rank: int = 2,
) -> ActionLists:
    """Seq1F1B-I: interleaved 1F1B over units, v = ``stages_per_rank`` chunks per rank.

    Loop placement: rank r holds stages r, r + p, ..., r + (v - 1) p. Work
    rotates over the chunks in rounds of p microbatches (p k units, see
    :func:`_rounds`): forward runs a round's units through chunk 0, then chunk
    1, ..., backward through chunk v - 1 down to chunk 0, last subsequence
    first. The released Seq1F1B-I rotates in rounds of p *units*, which
    deadlocks or breaks the backward order unless k divides p.

    Rank r warms up with (v - 1) R k + k + 2 (p - 1 - r) forwards (R: the
    first round's microbatches): up to its forward of the last chunk's first
    backward unit (microbatch 0, subsequence k - 1), plus the time that unit
    takes to reach the last rank and its backward to come back. Peak in-flight
    units on rank 0: that warm-up, at most v N k. Bubble ratio under uniform
    costs: (p - 1) / (v N k + p - 1) when p divides N.
    """
    p, k, v = num_ranks, num_subsequences, stages_per_rank
    rounds = _rounds(p, num_microbatches, k)
    orders = [unit_orders(mbs, k) for mbs in rounds]
    actions: ActionLists = {}
    for r in range(p):
        fwd = [(c * p + r, u) for f, _ in orders for c in range(v) for u in f]
        bwd = [(c * p + r, u) for _, b in orders for c in reversed(range(v)) for u in b]
        warmup = (v - 1) * len(rounds[0]) * k + 2 * (p - 1 - r) + k
        actions[r] = one_f_one_b(min(len(fwd), warmup), fwd, bwd, split_backward)
    return actions


class ScheduleInterleavedSeq1F1B(SequenceSchedule):
    """Seq1F1B-I: interleaved 1F1B over units, v stages per rank in loop placement;
    see :func:`interleaved_seq1f1b_actions`."""

    actions_fn = staticmethod(interleaved_seq1f1b_actions)
    stages_per_rank = 2


