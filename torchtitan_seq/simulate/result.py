"""What a simulated step returns: the timeline with what only the simulation knows (:class:`SimResult`),
and where the ranks stopped when none could progress (:class:`Deadlock`).

Activations are in M, one microbatch's activations on 1/p of the layers: unit j on a stage with 1/V of
the rank's layers weighs (L_j / S) / V from its F until its backward ends (B, or W where backward is
split: W needs the inputs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torchtitan_seq.instrumentation.render import Interval, Timeline
from torchtitan_seq.runtime.torch_internals import Action
from torchtitan_seq.schedules.ordering import B, F, W

__all__ = ["StuckRank", "Deadlock", "SimResult"]


@dataclass(frozen=True)
class StuckRank:
    """Where one rank stopped: the action at ``index`` of its list (see :class:`Deadlock`)."""

    rank: int
    index: int
    action: str
    waits_for: str


@dataclass(frozen=True)
class Deadlock:
    """No rank could progress.

    ``list_kind`` is "lowered" (indices into the lowered lists the runtime
    runs) or "compute-only" (torch's lowering rejected the lists; indices
    into the compute-only lists).
    """

    list_kind: str
    stuck: tuple[StuckRank, ...]

    def describe(self) -> str:
        where = "; ".join(
            f"rank {s.rank} stuck at action {s.index} ({s.action}) waiting for {s.waits_for}" for s in self.stuck
        )
        return f"no rank can progress ({self.list_kind} lists): {where}"


@dataclass(kw_only=True)
class SimResult(Timeline):
    """A simulated step: the timeline plus what only the simulation knows;
    :meth:`summary` is what ``--json`` prints."""

    cost: str
    lengths: list[int]
    parameter_copies: int
    deadlock: Deadlock | None
    lowered: dict[int, list[Action]] = field(repr=False)
    time_unit: str = "forwards of one microbatch on 1/p of the layers"
    copies_synced: list[float] = field(default_factory=list)
    """Per rank, when the all-reduces of its parameter copies end (the step's last
    communication); empty for a schedule with one copy."""

    @property
    def makespan(self) -> float:
        """The step: the last compute, or the copies' all-reduces after it."""
        return max([super().makespan, *self.copies_synced])

    @functools.cached_property
    def peak_activations(self) -> list[float]:
        """Per rank, in M (see the module docstring); worked out when asked (the planner never does)."""
        share = self.parameter_copies / self.stages_per_rank  # a stage's layers over a 1/p stage's
        weights = [length / sum(self.lengths) * share for length in self.lengths]
        return [_peak(self.timeline[r], weights, self.subsequences) for r in sorted(self.timeline)]

    def title(self) -> str:
        return (
            f"{self.label()}  cost={self.cost}  bubble ratio {self.bubble_ratio:.4f}  "
            f"makespan {self.makespan:.4g}  peak activations rank 0 {self.peak_activations[0]:.4g} M"
        )

    def warning(self) -> str | None:
        return self.deadlock.describe() if self.deadlock else None

    def summary(self) -> dict:
        return {name: getattr(self, name) for name in _SUMMARY} | {"deadlock": self.warning() or False}


_SUMMARY = (
    "schedule",
    "pp",
    "microbatches",
    "subsequences",
    "stages_per_rank",
    "split_backward",
    "cost",
    "lengths",
    "bubble_ratio",
    "makespan",
    "peak_activations",
    "parameter_copies",
    "copies_synced",
)


def _peak(intervals: list[Interval], weights: list[float], k: int) -> float:
    """Largest sum of live unit weights; a rank runs one action at a time, so
    the peak is reached right after some forward."""
    live = peak = 0.0
    for _, _, a in intervals:
        w = weights[a.microbatch_index % k]
        if a.computation_type == F:
            live += w
            peak = max(peak, live)
        elif a.computation_type in (B, W):
            live -= w
    return peak
