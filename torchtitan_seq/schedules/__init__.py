"""Sequence-level pipeline schedules, one module per family.

* :mod:`.seq1f1b`: ``Seq1F1B`` and ``TeraPipe`` (one stage per rank);
* :mod:`.interleaved`: ``InterleavedSeq1F1B`` (v stages per rank);
* :mod:`.bsipipe`: ``BSIPipe`` (two V-shaped chains) and :mod:`.chimera`:
  ``Chimera`` (two straight chains), with :mod:`.bidirectional` (two chains in
  opposite directions: layout, lowering, mirrored copies, their runtime);
* :mod:`.base`: the runtime they share; ``_common``: unit orders and 1F1B.

Each schedule is a short pure function ``(num_ranks, num_microbatches,
num_subsequences) -> {rank: [compute actions]}`` over (microbatch, subsequence)
units, numbered ``unit id = m * k + j`` (a multi-stage schedule's also takes
``stages_per_rank``), plus a thin
``_PipelineScheduleRuntime`` subclass that validates the lists
(:mod:`torchtitan_seq.ordering`) and hands them to torch's own lowering
(send/recv, FSDP unshard/reshard, gradient reduction) and executor.

Usage with plain ``torch.distributed.pipelining``::

    lengths = partition_sequence(seq_len, 4, "even")
    stage = SequencePipelineStage(chunk, rank, world, device, lengths=lengths)
    schedule = ScheduleSeq1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    losses = []
    schedule.step(tokens, target=labels, losses=losses)  # tokens: (batch, seq_len)

``loss_fn(output, target)`` receives one unit and must return that unit's
share of the step's loss: the *sum* of its token losses divided by the
step's token count (see :class:`torchtitan_seq.loss.TokenNormalizedLoss`), so
that summing units is exact for uneven subsequences. ``losses`` receives one
loss per microbatch, as with torch's schedules.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as _torch_schedules

from ._common import ActionLists
from .base import SequenceSchedule, StagePlacement
from .bidirectional import PLACEMENTS, BidirectionalLayout, BidirectionalSchedule, MirroredCopies, lower_chains
from .bsipipe import ScheduleBSIPipe, bsipipe_actions
from .chimera import ScheduleChimera, chimera_actions
from .interleaved import ScheduleInterleavedSeq1F1B, interleaved_seq1f1b_actions
from .seq1f1b import (
    ScheduleSeq1F1B,
    ScheduleTeraPipe,
    seq1f1b_actions,
    terapipe_actions,
)

__all__ = [
    "ActionLists",
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
    "Seq1F1B": ScheduleSeq1F1B,
    "TeraPipe": ScheduleTeraPipe,
    "InterleavedSeq1F1B": ScheduleInterleavedSeq1F1B,
    "BSIPipe": ScheduleBSIPipe,
    "Chimera": ScheduleChimera,
}

# torch's concrete schedules, by the names get_schedule_class takes ("Schedule1F1B" -> "1F1B").
TORCH_SCHEDULES = tuple(
    name.removeprefix("Schedule") for name in _torch_schedules.__all__ if name.startswith("Schedule")
)
