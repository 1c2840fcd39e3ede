"""The search in several processes: which process visits each candidate, and a helper's visit of its
share ahead of the search (:mod:`torchtitan_seq.plan.lookahead`)."""

from __future__ import annotations

from collections.abc import Callable

from torchtitan_seq.plan.bounds import Candidate
from torchtitan_seq.plan.lookahead import SKIP
from torchtitan_seq.plan.record import Plan
from torchtitan_seq.plan.twins import Kept


def shares(candidates: list[Candidate], processes: int) -> list[int]:
    """Per candidate, the process that visits it: schedule shapes (schedule, k, v, p) dealt round
    the processes in the order the search first meets them, so that a shape's lists, their
    preparation for timing and the memory model's walks are built in one process only."""
    order: dict[tuple, int] = {}
    shape = [(c.choice.schedule, c.choice.num_subsequences, c.choice.stages_per_rank, c.pp) for c in candidates]
    return [order.setdefault(s, len(order)) % processes for s in shape]


def answers_ahead(candidates: list[Candidate], visit: Callable[[int], Plan | None]) -> Callable[[int], object]:
    """A helper's work: visit the candidates of its share, skipping as the search skips the heavier
    twins of those that fit (it goes on past where the search stops, until stopped)."""
    kept = Kept()

    def work(i: int) -> object:
        if kept.skips(candidates[i]):
            return SKIP
        if (measured := visit(i)) is not None:
            kept.keep(candidates[i])
        return measured

    return work
