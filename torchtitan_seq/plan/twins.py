"""Twin pruning: a configuration is slower than its twin of the same schedule choice and p with no
more TP, CP and recomputation, so once one fits its heavier twins are left out."""

from __future__ import annotations

from torchtitan_seq.plan.bounds import Candidate
from torchtitan_seq.plan.choices import AC_MODES, ScheduleChoice


def no_heavier(lighter: tuple[int, int, int], degrees: tuple[int, int, int]) -> bool:
    """Whether degrees (TP, CP, AC mode) ``lighter`` are nowhere more than ``degrees``."""
    return all(map(int.__le__, lighter, degrees))


class Kept:
    """The degrees (TP, CP, AC mode) of the candidates kept, per schedule choice and p: a candidate
    with a kept twin no heavier than it is skipped."""

    def __init__(self) -> None:
        self.degrees: dict[tuple[ScheduleChoice, int], list[tuple[int, int, int]]] = {}

    @staticmethod
    def _twins(c: Candidate) -> tuple[tuple[ScheduleChoice, int], tuple[int, int, int]]:
        return (c.choice, c.pp), (c.tp, c.cp, AC_MODES.index(c.ac))

    def skips(self, c: Candidate) -> bool:
        key, degrees = self._twins(c)
        return any(no_heavier(lighter, degrees) for lighter in self.degrees.get(key, []))

    def keep(self, c: Candidate) -> tuple[tuple[ScheduleChoice, int], tuple[int, int, int]]:
        """Keep ``c``; returns its schedule choice and p, and its degrees."""
        key, degrees = self._twins(c)
        self.degrees.setdefault(key, []).append(degrees)
        return key, degrees
