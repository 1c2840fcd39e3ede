"""What the search tries on every split of the GPUs: the schedule choices (a schedule with its k,
partition and stages per rank), the TP and CP degrees, and the activation checkpointing modes with
the forward passes each recomputes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from torchtitan_seq.runtime.partition import Partition
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.memory import ACMode

AC_MODES: tuple[ACMode, ...] = get_args(ACMode)
# Forward passes recomputed per backward: torchtitan's 'selective' default checkpoints every 2nd layer.
RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0}
TP_DEGREES = (1, 2, 4, 8)
CP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ScheduleChoice:
    """A schedule with its own settings, independent of the GPUs it runs on."""

    schedule: str
    num_subsequences: int = 1
    partition: Partition = "even"
    stages_per_rank: int = 1

    @property
    def parameter_copies(self) -> int:
        """Copies of each model chunk (2 for the two-chain schedules)."""
        return getattr(SEQUENCE_SCHEDULES.get(self.schedule), "parameter_copies", 1)


def schedule_choices() -> list[ScheduleChoice]:
    torch_choices = [
        ScheduleChoice("1F1B"),
        ScheduleChoice("GPipe"),
        ScheduleChoice("Interleaved1F1B", stages_per_rank=2),
    ]
    seq = [ScheduleChoice("Seq1F1B", k, part) for k in (2, 4, 8, 16) for part in ("even", "compute")]
    seq += [ScheduleChoice("InterleavedSeq1F1B", k, part, 2) for k in (2, 4, 8) for part in ("even", "compute")]
    seq += [ScheduleChoice("TeraPipe", k, "latency") for k in (2, 4, 8)]
    for name in ("BSIPipe", "Chimera"):
        if name in SEQUENCE_SCHEDULES:
            v = SEQUENCE_SCHEDULES[name].stages_per_rank
            seq += [ScheduleChoice(name, 1, "even", v)] + [ScheduleChoice(name, k, "compute", v) for k in (2, 4)]
    return torch_choices + seq


CHOICES: list[ScheduleChoice] = schedule_choices()
"""What the search tries on every pipeline degree."""
