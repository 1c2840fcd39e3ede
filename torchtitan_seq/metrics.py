"""torchtitan's metrics, plus what sequence pipelines need to show.

Per logged step, every rank's peak activation bytes (measured by
:class:`~torchtitan_seq.memory.ActivationMemory`) join torchtitan's metrics:
in TensorBoard as ``memory/peak_activation_bytes/rank{r}`` and on the
console as one line after torchtitan's step line (MiB, then exact bytes).
So do every rank's measured bubble ratio of the step and the step's
pipeline makespan (:mod:`torchtitan_seq.timeline`), as
``pipeline/bubble_ratio/rank{r}`` and ``pipeline/makespan(s)``. On
the steps torchtitan's profiler traces, or every N steps with
``TORCHTITAN_SEQ_TIMELINE_FREQ=N`` (:func:`~torchtitan_seq.timeline.export_due`),
the step's pipeline timeline is written as a Chrome trace in torchtitan's
profiling folder (``iteration_{step}/pipeline_timeline.json``) and as the
TensorBoard image ``pipeline/timeline``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor, TensorBoardLogger
from torchtitan.tools.logging import logger

from . import timeline
from .memory import ActivationMemory
from .schedules import SEQUENCE_SCHEDULES

__all__ = ["SeqMetricsProcessor", "build_seq_metrics_processor"]


class SeqMetricsProcessor(MetricsProcessor):
    """torchtitan's ``MetricsProcessor`` that also reports, per rank, activation memory and
    the pipeline's bubble ratio."""

    activation_memory: ActivationMemory | None = None

    def _gather_per_rank(self) -> list[tuple[int, float, float]]:
        """Every rank's (peak activation bytes, busy ms, latest action end ms), in one all-gather."""
        peak = self.activation_memory.peak if self.activation_memory else 0
        local = torch.tensor([peak, *timeline.local_step()], dtype=torch.float64,
                             device=self.device_memory_monitor.device)
        gathered = [local]
        if dist.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        return [(int(t[0]), float(t[1]), float(t[2])) for t in gathered]

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        per_rank = self._gather_per_rank()
        peaks = [peak for peak, _, _ in per_rank]
        ends = [end for _, _, end in per_rank]
        bubbles = timeline.bubble_ratios([busy for _, busy, _ in per_rank], ends)
        makespan_ms = max(ends)
        metrics = dict(extra_metrics or {})
        metrics.update({f"memory/peak_activation_bytes/rank{r}": b for r, b in enumerate(peaks)})
        metrics.update({f"pipeline/bubble_ratio/rank{r}": x for r, x in enumerate(bubbles)})
        if bubbles:
            metrics["pipeline/makespan(s)"] = makespan_ms / 1e3
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=metrics)
        mib = ", ".join(f"rank{r} {b / 2**20:.1f}" for r, b in enumerate(peaks))
        line = f"step: {step:2}  peak activations (MiB): {mib}  bytes: {', '.join(map(str, peaks))}"
        if bubbles:
            line += "  bubble ratio: " + ", ".join(f"rank{r} {x:.4f}" for r, x in enumerate(bubbles))
            line += f"  pipeline: {makespan_ms:.1f} ms"
        logger.info(line)
        if timeline.export_due(step, self.job_config.profiling):
            self._export_timeline(step)

    def _export_timeline(self, step: int) -> None:
        name = self.job_config.parallelism.pipeline_parallel_schedule
        k = self.job_config.sequence_pipeline.num_subsequences if name in SEQUENCE_SCHEDULES else 1
        loggers = getattr(self.logger, "_loggers", [])  # torchtitan's LoggerContainer
        writers = [lg.writer for lg in loggers if isinstance(lg, TensorBoardLogger)]
        folder = Path(self.job_config.job.dump_folder) / self.job_config.profiling.save_traces_folder
        timeline.export_timeline(step, name, k, folder, writers)


def build_seq_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """torchtitan's ``build_metrics_processor_fn`` contract; starts timing pipeline actions."""
    processor = SeqMetricsProcessor(job_config, parallel_dims, tag)
    timeline.RECORDER.enable(processor.device_memory_monitor.device)
    return processor
