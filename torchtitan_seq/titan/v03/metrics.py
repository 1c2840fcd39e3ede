"""torchtitan 0.3's ``MetricsProcessor`` with the sequence pipeline's metrics and record
(:class:`torchtitan_seq.titan.metrics.SequenceMetrics`: per-rank activation peaks and bubble ratios, the
pipeline timeline, ``metrics.jsonl``), as under 0.2.2.

0.3 builds the processor from its config (``metrics``) with only the metrics section and the dump
folder; the trainer hands it the rest of the job's settings when it is built (:meth:`SeqMetricsProcessor.attach`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from torchtitan_seq.titan.metrics import SequenceMetrics, SequenceMetricsSettings

__all__ = ["SeqMetricsProcessor"]


class SeqMetricsProcessor(SequenceMetrics, MetricsProcessor):
    """0.3's ``MetricsProcessor`` with :class:`~torchtitan_seq.titan.metrics.SequenceMetrics`."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """0.3's metrics section; the processor it builds also reports the sequence pipeline."""

    _settings: SequenceMetricsSettings | None = None

    @property
    def settings(self) -> SequenceMetricsSettings:
        """The settings :class:`SequenceMetrics` reads, as :meth:`attach` took them.

        Raises:
            RuntimeError: :meth:`attach` was not called.
        """
        if self._settings is None:
            raise RuntimeError("SeqMetricsProcessor.attach was not called (SeqTrainer calls it)")
        return self._settings

    def attach(self, trainer_config: Any) -> None:
        """Read the job's settings off 0.3's trainer config and start the record on rank 0.

        Args:
            trainer_config: the job's :class:`~torchtitan_seq.titan.v03.trainer.SeqTrainer` config.
        """
        self._settings = SequenceMetricsSettings(
            sequence_pipeline=trainer_config.sequence_pipeline,
            schedule=trainer_config.parallelism.pipeline_parallel_schedule,
            log_freq=self.config.log_freq,
            dump_folder=Path(trainer_config.dump_folder),
            profiling=trainer_config.profiler,
        )
        self.attach_record()
