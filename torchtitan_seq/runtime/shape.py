"""One job's shape: how it cuts each sequence and how many microbatches and chunks it runs.

The runtime (:mod:`torchtitan_seq.titan.v022.pipeline`), the job check, the simulator, the memory model and
the planner all take the subsequence lengths from a :class:`JobShape`, so that the planner
evaluates the very cut the runtime trains: k lengths from
:func:`~torchtitan_seq.runtime.partition.partition_sequence`, each a whole multiple of
lcm(``length_multiple``, TP degree) (sequence parallelism shards a unit's tokens TP ways; under
context parallelism, of 2 CP x TP).
Plain Python: neither torch nor torchtitan is imported.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from torchtitan_seq.runtime.partition import Partition, UnitCost, partition_sequence

__all__ = ["LENGTH_MULTIPLE", "JobShape"]

LENGTH_MULTIPLE = 1
"""The default of ``[sequence_pipeline] length_multiple``, and of the simulator's, the memory
model's and the planner's: any length (TP still rounds it). The shipped configs set their own
(64 for the debug model, 128 for 8B), as GPU kernels prefer."""


@dataclass(frozen=True)
class JobShape:
    """What a job runs per pipeline step, derived once from its settings."""

    seq_len: int
    """S, tokens per sequence (``training.seq_len``)."""
    num_subsequences: int = 1
    """k, units each microbatch's sequence is cut into (``sequence_pipeline.num_subsequences``)."""
    partition: Partition = "even"
    """How the sequence is cut (``sequence_pipeline.partition``)."""
    cost: UnitCost | None = None
    """The model's unit cost, which the 'compute' and 'latency' partitions balance (None for 'even')."""
    length_multiple: int = LENGTH_MULTIPLE
    """``sequence_pipeline.length_multiple``."""
    tp: int = 1
    """The TP degree."""
    microbatches: int = 1
    """N, microbatches per step and pipeline (local batch size / microbatch size)."""
    stages_per_rank: int | None = None
    """v, model chunks per pipeline rank; None: the schedule's own."""
    whole: bool = False
    """True for torch's schedules: they run each sequence as one unit, uncut."""
    cp: int = 1
    """The CP degree: every unit is cut into 2 ``cp`` equal chunks (:mod:`torchtitan_seq.runtime.context_parallel`)."""

    def __post_init__(self) -> None:
        # lcm() would take a negative multiple for its absolute value and 0 for "no cut" silently.
        if self.length_multiple < 1:
            raise ValueError(
                f"sequence_pipeline.length_multiple = {self.length_multiple}: it must be at least 1 (1: any length)"
            )

    @classmethod
    def of_model(
        cls,
        model_args: Any,
        seq_len: int,
        num_subsequences: int = 1,
        partition: Partition = "even",
        *,
        document_length: float = 0.0,
        **fields: Any,
    ) -> JobShape:
        """The shape of a job on a model, its unit cost taken from the model where the partition needs it.

        Args:
            model_args: torchtitan's ``TransformerModelArgs`` or a :class:`~torchtitan_seq.titan.flavors.ModelShape`.
            seq_len: S, tokens per sequence.
            num_subsequences: k.
            partition: how the sequence is cut.
            document_length: the expected tokens per packed document
                (``sequence_pipeline.expected_document_length``); 0: causal attention.
            **fields: the other fields of :class:`JobShape`.

        Returns:
            The job's shape.
        """
        cost = None if partition == "even" else UnitCost.from_model_args(model_args, document_length or None)
        return cls(seq_len, num_subsequences, partition, cost, **fields)

    @property
    def multiple(self) -> int:
        """What every subsequence length is a multiple of: lcm(length_multiple, tp), and under context
        parallelism of 2 cp x tp (2 cp chunks, each CP rank's two sharded TP ways), as torchtitan asks of
        whole sequences."""
        return math.lcm(self.length_multiple, self.tp * (2 * self.cp if self.cp > 1 else 1))

    @property
    def lengths(self) -> list[int]:
        """[L_0, ..., L_{k-1}]: the subsequence lengths ([S] for torch's schedules). Raises
        ValueError, naming the setting, for a cut that cannot be made."""
        if self.whole:
            return [self.seq_len]
        return list(_cut(self.seq_len, self.num_subsequences, self.partition, self.multiple, self.cost))


@functools.lru_cache(maxsize=1024)
def _cut(seq_len: int, k: int, partition: Partition, multiple: int, cost: UnitCost | None) -> tuple[int, ...]:
    """partition_sequence, once per cut: the planner asks for each cut on every mesh it tries."""
    return tuple(partition_sequence(seq_len, k, partition, multiple=multiple, cost=cost))
