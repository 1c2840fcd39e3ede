"""What a torchtitan version's ``Trainer`` does for a sequence pipeline, the same under every version:
instrumented steps, the activation and K/V context meters and the loss every pipeline rank logs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.schedules import SequenceSchedule
from torchtitan_seq.titan import cpu_compat
from torchtitan_seq.titan.metrics import SequenceMetrics

__all__ = ["InstrumentedSteps"]


class InstrumentedSteps:
    """What a torchtitan version's ``Trainer`` steps do for a sequence pipeline, under every version.

    Mixed into the version's ``Trainer`` (before it). Each training step runs under its metrics
    processor's :meth:`~torchtitan_seq.titan.metrics.SequenceMetrics.instrumented_step`; :attr:`metering`
    says whether the step meters activations (:meth:`metered`: the trainer's forward and backward then
    run under its meter); every pipeline rank learns the step's loss (:meth:`loss_on_every_rank`)."""

    metering: bool = False
    """Whether the running step meters saved activations; False between steps."""
    activation_memory: ActivationMemory
    """The trainer's activation meter, set before torchtitan builds the job."""
    kv_memory: KVMemory | None = None
    """The K/V context meter of a sequence schedule's stages on this rank; None under torch's schedules."""

    @contextlib.contextmanager
    def metered(self) -> Iterator[None]:
        """The activation and K/V context meters on the steps that meter, else nothing.

        Returns:
            A context manager: :meth:`ActivationMemory.track` and :meth:`KVMemory.track` while
            :attr:`metering`, else a null one.
        """
        with contextlib.ExitStack() as meters:
            if self.metering:
                meters.enter_context(self.activation_memory.track())
                if self.kv_memory is not None:
                    meters.enter_context(self.kv_memory.track())
            yield

    def loss_on_every_rank(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss on every pipeline rank, summed over the ranks that hold a last stage.

        The ranks of a last stage hold the loss (two under BSIPipe and Chimera, one per chain, each its
        chain's share); the others, whose loss torchtitan gives as -1, add zero.

        Args:
            loss: this rank's loss of the step, a scalar (a DTensor under loss parallelism).

        Returns:
            The sum over the pipeline ranks' losses, detached, a scalar tensor.
        """
        if isinstance(loss, DTensor):  # loss parallel under TP
            loss = loss.full_tensor()
        loss = loss.detach().reshape(()) if self.pp_has_last_stage else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
        return loss

    def attach_sequence_pipeline(self) -> None:
        """Finish the job torchtitan built for a sequence pipeline; the trainer calls it once.

        Called after torchtitan built the job and the version's metrics processor is attached: FSDP
        reduces over gloo on a CPU, the mirror copies of a schedule with parameter copies follow the
        optimizer, and the metrics processor gets the meters and writes the record's start.
        """
        cpu_compat.fsdp_for_gloo(self.model_parts)
        schedule = getattr(self, "pp_schedule", None)
        if isinstance(schedule, SequenceSchedule):
            # e.g. BSIPipe, Chimera: the optimizer steps each chunk's primary copy; the mirror copy follows.
            self.optimizers.register_step_post_hook(lambda *_: schedule.after_optimizer_step())
            self.kv_memory = KVMemory([stage.kv_context for stage in schedule.stages])
        if isinstance(self.metrics_processor, SequenceMetrics):
            self.metrics_processor.activation_memory = self.activation_memory
            self.metrics_processor.kv_memory = self.kv_memory
            self.metrics_processor.record_start(schedule)

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        """torchtitan's training step, run inside the metrics processor's instrumented step.

        Under a metrics processor that is no :class:`~torchtitan_seq.titan.metrics.SequenceMetrics`,
        torchtitan's step runs as it is.

        Args:
            data_iterator: the batches, as the version's ``train_step`` takes them.
        """
        processor = self.metrics_processor
        if not isinstance(processor, SequenceMetrics):
            return super().train_step(data_iterator)
        try:
            with processor.instrumented_step(self.step, self.device) as self.metering:  # step: already the step's
                super().train_step(data_iterator)
        finally:
            self.metering = False
