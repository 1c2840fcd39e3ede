"""torchtitan 0.2.2's metrics processor with the sequence pipeline's metrics and record
(:class:`torchtitan_seq.titan.metrics.SequenceMetrics`), its settings read off the job config."""

from __future__ import annotations

from pathlib import Path

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model import BaseModelArgs

from torchtitan_seq.titan.metrics import SequenceMetrics, SequenceMetricsSettings

__all__ = ["SeqMetricsProcessor", "build_seq_metrics_processor"]


class SeqMetricsProcessor(SequenceMetrics, MetricsProcessor):
    """torchtitan 0.2.2's ``MetricsProcessor`` with :class:`SequenceMetrics`; the settings are the job's."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, tag: str | None = None) -> None:
        """torchtitan's processor, with the structured record started on rank 0.

        Args:
            job_config: the job's config.
            parallel_dims: the job's parallel degrees and meshes.
            tag: torchtitan's logger tag, if any.
        """
        super().__init__(job_config, parallel_dims, tag)
        self.attach_record()

    @property
    def settings(self) -> SequenceMetricsSettings:
        """The settings :class:`SequenceMetrics` reads, off the job config."""
        job = self.job_config
        return SequenceMetricsSettings(
            sequence_pipeline=job.sequence_pipeline,
            schedule=job.parallelism.pipeline_parallel_schedule,
            log_freq=job.metrics.log_freq,
            dump_folder=Path(job.job.dump_folder),
            profiling=job.profiling,
        )


def build_seq_metrics_processor(
    job_config: JobConfig, parallel_dims: ParallelDims, model_args: BaseModelArgs | None = None, tag: str | None = None
) -> SeqMetricsProcessor:
    """torchtitan's ``build_metrics_processor_fn`` contract: the train spec's metrics processor.

    Args:
        job_config: the job's config.
        parallel_dims: the job's parallel degrees and meshes.
        model_args: the flavor's model args, which the contract passes and the processor does not read.
        tag: torchtitan's logger tag, if any.

    Returns:
        A :class:`SeqMetricsProcessor`.
    """
    return SeqMetricsProcessor(job_config, parallel_dims, tag)
