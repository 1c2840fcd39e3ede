"""Seq1F1B and TeraPipe: one stage per rank, 1F1B or GPipe over (microbatch, subsequence) units."""

from __future__ import annotations

from ._common import ActionLists, single_stage
from .base import SequenceSchedule

__all__ = ["seq1f1b_actions", "terapipe_actions", "ScheduleSeq1F1B", "ScheduleTeraPipe"]


def seq1f1b_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False
) -> ActionLists:
    """Seq1F1B (arXiv 2406.03488): 1F1B over units, one stage per rank.

    Rank r warms up with k + p - 1 - r forwards, so the first backward (the
    last subsequence of microbatch 0) arrives just as it is needed; then one
    backward and one forward alternate. Peak in-flight units on rank 0:
    min(p - 1 + k, N k).
    """
    k = num_subsequences
    return single_stage(num_ranks, num_microbatches, k, lambda r: k + num_ranks - 1 - r, split_backward)


def terapipe_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False
) -> ActionLists:
    """TeraPipe (ICML'21): GPipe over units, every forward then every backward, last unit first."""
    n = num_microbatches * num_subsequences
    return single_stage(num_ranks, num_microbatches, num_subsequences, lambda r: n, split_backward)


class ScheduleSeq1F1B(SequenceSchedule):
    """Seq1F1B: 1F1B over (microbatch, subsequence) units; see :func:`seq1f1b_actions`."""

    actions_fn = staticmethod(seq1f1b_actions)


class ScheduleTeraPipe(SequenceSchedule):
    """TeraPipe: GPipe over units; see :func:`terapipe_actions`."""

    actions_fn = staticmethod(terapipe_actions)


