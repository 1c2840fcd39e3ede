"""Sequence-level pipeline schedules, one module per family: :mod:`.seq1f1b`, :mod:`.interleaved`,
:mod:`.bsipipe` and :mod:`.chimera` (both on :mod:`.bidirectional`), on the runtime in :mod:`.base`.

Each schedule is a short pure function ``ScheduleShape -> {rank: [compute actions]}`` (p ranks, N
microbatches, k subsequences, split backward, v chunks per rank) over (microbatch, subsequence)
units, ``unit id = m * k + j``, plus a thin subclass of the runtime. With plain ``torch.distributed.pipelining``::

    lengths = partition_sequence(seq_len, 4, "even")
    stage = SequencePipelineStage(chunk, rank, world, device, lengths=lengths)
    schedule = ScheduleSeq1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    losses = []
    schedule.step(tokens, target=labels, losses=losses)  # tokens: (batch, seq_len)

``loss_fn(output, target)`` receives one unit and must return that unit's share of the step's loss:
the *sum* of its token losses divided by the step's token count
(:class:`torchtitan_seq.runtime.loss.TokenNormalizedLoss`), so that summing units is exact for uneven
subsequences. ``losses`` receives one loss per microbatch, as with torch's schedules.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as _torch_schedules

from torchtitan_seq.schedules.base import ActionLists, ScheduleShape, SequenceSchedule, StagePlacement
from torchtitan_seq.schedules.bidirectional import (
    PLACEMENTS,
    BidirectionalLayout,
    BidirectionalSchedule,
    MirroredCopies,
    Placement,
    lower_chains,
)
from torchtitan_seq.schedules.bsipipe import ScheduleBSIPipe, bsipipe_actions
from torchtitan_seq.schedules.chimera import ScheduleChimera, chimera_actions
from torchtitan_seq.schedules.interleaved import ScheduleInterleavedSeq1F1B, interleaved_seq1f1b_actions
from torchtitan_seq.schedules.seq1f1b import ScheduleSeq1F1B, ScheduleTeraPipe, seq1f1b_actions, terapipe_actions

__all__ = [
    "ActionLists",
    "ScheduleShape",
    "SequenceSchedule",
    "StagePlacement",
    "seq1f1b_actions",
    "terapipe_actions",
    "interleaved_seq1f1b_actions",
    "bsipipe_actions",
    "chimera_actions",
    "ScheduleSeq1F1B",
    "ScheduleTeraPipe",
    "ScheduleInterleavedSeq1F1B",
    "ScheduleBSIPipe",
    "ScheduleChimera",
    "Placement",
    "PLACEMENTS",
    "BidirectionalLayout",
    "BidirectionalSchedule",
    "MirroredCopies",
    "lower_chains",
    "SEQUENCE_SCHEDULES",
    "TORCH_SCHEDULES",
]

# Names users select in ``[parallelism] pipeline_parallel_schedule``.
SEQUENCE_SCHEDULES: dict[str, type[SequenceSchedule]] = {
    cls.__name__.removeprefix("Schedule"): cls
    for cls in (ScheduleSeq1F1B, ScheduleTeraPipe, ScheduleInterleavedSeq1F1B, ScheduleBSIPipe, ScheduleChimera)
}

# torch's concrete schedules, by the names get_schedule_class takes ("Schedule1F1B" -> "1F1B").
TORCH_SCHEDULES = tuple(n.removeprefix("Schedule") for n in _torch_schedules.__all__ if n.startswith("Schedule"))
