"""Seq1F1B-I: interleaved 1F1B over units, v model chunks per rank in loop placement."""

from __future__ import annotations

from torchtitan_seq.schedules.base import ActionLists, ScheduleShape, SequenceSchedule
from torchtitan_seq.schedules.seq1f1b import one_f_one_b, unit_orders

__all__ = ["interleaved_seq1f1b_actions", "ScheduleInterleavedSeq1F1B"]


def interleaved_seq1f1b_actions(shape: ScheduleShape) -> ActionLists:
    """Seq1F1B-I: interleaved 1F1B over units, v = ``shape.stages_per_rank`` chunks per rank.

    Rank r holds stages r, r + p, ..., r + (v - 1) p. Work rotates over the chunks in rounds of p
    microbatches: forward runs a round's units through chunk 0, then chunk 1, ..., backward through
    chunk v - 1 down to chunk 0, last subsequence first. (The released Seq1F1B-I rotates in rounds of
    p *units*, which deadlocks or breaks the backward order unless k divides p.) The N mod p
    microbatches left over are a final, shorter round when they hold at least p units, enough to
    keep the pipeline busy while the ranks pass a round's units down their chunks; fewer would stall
    the pipeline (at k = 1 they can deadlock torch's send/recv lowering), so they are spread over the
    earlier rounds, one each, first rounds first.

    Rank r warms up with (v - 1) R k + k + 2 (p - 1 - r) forwards (R: the first, largest round's
    microbatches): up to its forward of the last chunk's first backward unit, plus that unit's round
    trip to the last rank. Peak in-flight units on rank 0: that warm-up, at most v N k. Bubble ratio
    under uniform costs: (p - 1) / (v N k + p - 1) when p divides N.
    """
    p, n, k, v = shape.num_ranks, shape.num_microbatches, shape.num_subsequences, shape.stages_per_rank
    full, rest = divmod(n, p)
    if full == 0 or rest * k >= p:
        sizes = [p] * full + ([rest] if rest else [])
    else:
        sizes = [n // full + (i < n % full) for i in range(full)]
    orders = [unit_orders(range(sum(sizes[:i]), sum(sizes[: i + 1])), k) for i in range(len(sizes))]
    actions: ActionLists = {}
    for r in range(p):
        fwd = [(c * p + r, u) for f, _ in orders for c in range(v) for u in f]
        bwd = [(c * p + r, u) for _, b in orders for c in reversed(range(v)) for u in b]
        warmup = (v - 1) * sizes[0] * k + 2 * (p - 1 - r) + k
        actions[r] = one_f_one_b(min(len(fwd), warmup), fwd, bwd, shape.split_backward)
    return actions


class ScheduleInterleavedSeq1F1B(SequenceSchedule):
    """Seq1F1B-I, v stages per rank; see :func:`interleaved_seq1f1b_actions`."""

    actions_fn = staticmethod(interleaved_seq1f1b_actions)
    stages_per_rank = 2
