"""torchtitan's metrics, plus what sequence pipelines need to show, and a structured record.

:class:`SequenceMetrics` holds it all for any torchtitan version's ``MetricsProcessor``: 0.2.2's is
:class:`torchtitan_seq.titan.v022.metrics.SeqMetricsProcessor`, 0.3's
:class:`torchtitan_seq.titan.v03.metrics.SeqMetricsProcessor`; each says where its job keeps the settings
(:class:`SequenceMetricsSettings`).

Per logged step, every rank's bubble ratio and the step's pipeline makespan
(:mod:`torchtitan_seq.instrumentation.timeline`), and on the steps that meter activations
(:meth:`SequenceMetrics.meters_activations`) every rank's peak activation
bytes (:class:`~torchtitan_seq.instrumentation.memory.ActivationMemory`; on CUDA also the
allocator's peak; under a sequence schedule the K/V context's peak,
:class:`~torchtitan_seq.instrumentation.kv_memory.KVMemory`) join torchtitan's metrics (TensorBoard tags:
:data:`PER_RANK_FIELDS`, ``pipeline/makespan(s)``) and its console (a line after
torchtitan's step line); on the steps
:func:`~torchtitan_seq.instrumentation.timeline.export_due` picks, the step's timeline is
exported (:func:`~torchtitan_seq.instrumentation.timeline.export_timeline`). Rank 0 appends
every record to ``<dump_folder>/metrics.jsonl`` (:data:`RECORD_FILE`), whose
schema docs/metrics.md gives.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, LoggerContainer, TensorBoardLogger
from torchtitan.tools.logging import logger

from torchtitan_seq.instrumentation import timeline
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.instrumentation.record import RECORD_FILE
from torchtitan_seq.instrumentation.render import bubble_ratios, busy_and_end
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, SequenceSchedule

__all__ = ["RECORD_FILE", "STEP_FIELDS", "MetricsRecord", "SequenceMetricsSettings", "SequenceMetrics"]

STEP_FIELDS = {
    "loss": "loss_metrics/global_avg_loss",
    "max_loss": "loss_metrics/global_max_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "n_tokens_seen": "n_tokens_seen",
    "tps": "throughput(tps)",
    "tflops": "tflops",
    "mfu_pct": "mfu(%)",
    "end_to_end_s": "time_metrics/end_to_end(s)",
    "data_loading_s": "time_metrics/data_loading(s)",
    "memory_gib": "memory/max_reserved(GiB)",
    "memory_pct": "memory/max_reserved(%)",
    "max_active_gib": "memory/max_active(GiB)",
    "pipeline_s": "pipeline/makespan(s)",
}
"""A step record's fields: the name of each in the metrics torchtitan logs (TensorBoard's tags).
``tps`` is tokens/s per device; ``memory_*`` is max reserved, the console's ``memory``."""

VALIDATION_FIELDS = {
    "loss": "validation_metrics/loss",
    "tps": "validation_metrics/throughput(tps)",
    "memory_gib": "validation_metrics/memory/max_reserved(GiB)",
}
"""A validation record's fields: the name of each in the metrics torchtitan's validator logs."""

PER_RANK_FIELDS = {
    "peak_activation_bytes": "memory/peak_activation_bytes",
    "peak_allocated_bytes": "memory/peak_allocated_bytes",
    "peak_kv_bytes": "memory/peak_kv_bytes",
    "bubble_ratio": "pipeline/bubble_ratio",
}
"""A step record's lists by rank: the prefix of their per-rank metrics, ``{prefix}/rank{r}``."""

METERED_FIELDS = ("peak_activation_bytes", "peak_allocated_bytes", "peak_kv_bytes")
"""The per-rank fields a step record holds only when the step was metered (CUDA's allocator peak:
only on CUDA; the K/V context's: only under a sequence schedule); null otherwise, never an older step's
figure."""


class MetricsRecord(BaseLogger):
    """One of torchtitan's metric loggers, writing the structured record: a JSON line a logged step.

    It appends the metrics torchtitan hands its TensorBoard logger to ``path``, each line written and
    the file closed at once, so that a run that dies keeps every step it logged.

    Args:
        path: the record's file; its folder is created.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the file as one JSON line.

        Args:
            record: the line's fields; 0-dim tensors among the values are written as numbers.
        """
        with self.path.open("a") as f:
            # default=float: torchtitan may hand over 0-dim tensors (e.g. a dp-reduced token count).
            f.write(json.dumps(record, default=float) + "\n")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append a step's or a validation's record, its fields read off torchtitan's metrics.

        Args:
            metrics: the metrics torchtitan logs, by TensorBoard tag (:data:`STEP_FIELDS`,
                :data:`VALIDATION_FIELDS`; per-rank ones as ``{prefix}/rank{r}``, :data:`PER_RANK_FIELDS`).
            step: the training step.
        """
        validation = VALIDATION_FIELDS["loss"] in metrics
        fields = VALIDATION_FIELDS if validation else STEP_FIELDS
        record = {"event": "validation" if validation else "step", "step": step, "time": time.time()}
        record.update({field: metrics.get(name) for field, name in fields.items()})
        for field, prefix in ({} if validation else PER_RANK_FIELDS).items():  # {prefix}/rank0, rank1, ...
            values = []
            while (name := f"{prefix}/rank{len(values)}") in metrics:
                values.append(metrics[name])
            record[field] = None if field in METERED_FIELDS and not values else values
        self.append(record)


def _allocator_peak(device: torch.device) -> int:
    """The CUDA caching allocator's peak allocated bytes on ``device`` since torchtitan's memory
    monitor last reset the peaks (at every logged step); -1 off CUDA."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1


@dataclass(frozen=True)
class SequenceMetricsSettings:
    """What :class:`SequenceMetrics` reads of a job, wherever the torchtitan version keeps it."""

    sequence_pipeline: Any
    """The job's :class:`~torchtitan_seq.config.SequencePipeline`."""
    schedule: str
    """``parallelism.pipeline_parallel_schedule``."""
    log_freq: int
    """torchtitan's metrics ``log_freq``."""
    dump_folder: Path
    """The job's dump folder, where :data:`RECORD_FILE` and the exported timelines go."""
    profiling: Any
    """torchtitan's profiling section (``enable_profiling``, ``profile_freq``, ``save_traces_folder``)."""


class SequenceMetrics:
    """What a torchtitan version's ``MetricsProcessor`` adds for sequence pipelines, under every version.

    Mixed into the version's ``MetricsProcessor`` (before it): reports, per rank, activation memory and
    the pipeline's bubble ratio, and keeps the structured record on rank 0. The subclass provides
    :attr:`settings`; its trainer arms each step with :meth:`instrumented_step`."""

    activation_memory: ActivationMemory | None = None
    """The trainer's meter; without one no step is metered."""
    kv_memory: KVMemory | None = None
    """The trainer's K/V context meter (a sequence schedule's); None: no K/V figure."""
    record: MetricsRecord | None = None
    """The structured record, on rank 0 once :meth:`attach_record` ran; None elsewhere."""

    @property
    def settings(self) -> SequenceMetricsSettings:
        """The job's settings, read where the torchtitan version keeps them; each subclass provides it."""
        raise NotImplementedError

    def attach_record(self) -> None:
        """On rank 0, append every logged step to ``<dump_folder>/metrics.jsonl`` from now on."""
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            self.record = MetricsRecord(self.settings.dump_folder / RECORD_FILE)
            if not isinstance(self.logger, LoggerContainer):
                self.logger = LoggerContainer()  # torchtitan's plain BaseLogger: no backend here
            self.logger.add_logger(self.record)

    def record_start(self, schedule: object | None) -> None:
        """Append the start record: the schedule's name and the subsequence lengths it runs.

        Args:
            schedule: the trainer's pipeline schedule; None, or one of torch's, records no lengths.
        """
        if self.record is not None:
            lengths = schedule.lengths if isinstance(schedule, SequenceSchedule) else None
            name = self.settings.schedule
            self.record.append({"event": "start", "time": time.time(), "schedule": name, "lengths": lengths})

    def meters_activations(self, step: int) -> bool:
        """Whether a training step meters saved activations.

        Args:
            step: the training step, numbered from 1 as torchtitan numbers them.

        Returns:
            True for step 1 and the multiples of ``[sequence_pipeline] activation_memory_freq`` x
            ``metrics.log_freq`` (never when it is 0), with the trainer's meter attached
            (:attr:`activation_memory`).
        """
        settings = self.settings
        freq = settings.sequence_pipeline.activation_memory_freq
        due = freq > 0 and (step == 1 or step % (freq * settings.log_freq) == 0)
        return due and self.activation_memory is not None

    @contextlib.contextmanager
    def instrumented_step(self, step: int, device: torch.device) -> Iterator[bool]:
        """Arm the instrumentation around one training step, for the steps that report it only.

        The timeline recorder times the step's compute actions if the step logs; the meter and the
        timeline cost per saved tensor and per action, so other steps run without them.

        Args:
            step: the training step.
            device: this rank's device, whose actions the timeline times.

        Yields:
            Whether the step meters activations (:meth:`meters_activations`): the trainer then runs
            forward and backward under the meter.
        """
        if self.settings.sequence_pipeline.pipeline_timeline and self.should_log(step):
            timeline.RECORDER.enable(device)
        try:
            yield self.meters_activations(step)
        finally:
            timeline.RECORDER.disable()

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """torchtitan's step metrics, plus the sequence pipeline's per rank, logged and recorded.

        Every rank's bubble ratio and the pipeline makespan join the metrics, and on metered steps its
        peak activation bytes (and on CUDA the allocator's peak); a console line shows them, and the
        step's timeline is exported on the steps :func:`~torchtitan_seq.instrumentation.timeline.export_due`
        picks. Every rank calls it: the figures are all-gathered.

        Args:
            step: the training step.
            global_avg_loss: the step's loss, averaged over data-parallel ranks.
            global_max_loss: its maximum over data-parallel ranks.
            grad_norm: the gradients' total norm.
            extra_metrics: further metrics to log, by TensorBoard tag.
        """
        # Every rank's peak activation bytes, allocator peak and K/V context peak (-1: not measured), busy
        # ms and latest action end ms, in one all-gather. Every rank meters the same steps.
        metered = self.meters_activations(step)
        device = self.device_memory_monitor.device
        kv = self.kv_memory.peak if self.kv_memory is not None else -1
        peaks = [self.activation_memory.peak, _allocator_peak(device), kv] if metered else [-1, -1, -1]
        local = torch.tensor([*peaks, *busy_and_end(timeline.RECORDER.intervals())], dtype=torch.float64, device=device)
        gathered = [local]
        if dist.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        peaks, allocated, kv, busy, ends = torch.stack(gathered).T.tolist()
        per_rank = {"bubble_ratio": bubble_ratios(busy, ends)}
        if metered:
            per_rank["peak_activation_bytes"] = peaks = [int(b) for b in peaks]
        if metered and min(allocated) >= 0:
            per_rank["peak_allocated_bytes"] = allocated = [int(b) for b in allocated]
        if metered and min(kv) >= 0:
            per_rank["peak_kv_bytes"] = kv = [int(b) for b in kv]
        metrics = dict(extra_metrics or {})
        for field, values in per_rank.items():
            metrics.update({f"{PER_RANK_FIELDS[field]}/rank{r}": x for r, x in enumerate(values)})
        if bubbles := per_rank["bubble_ratio"]:
            metrics[STEP_FIELDS["pipeline_s"]] = max(ends) / 1e3
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=metrics)
        parts = []
        if metered:
            mib = ", ".join(f"rank{r} {b / 2**20:.1f}" for r, b in enumerate(peaks))
            parts.append(f"peak activations (MiB): {mib}  bytes: {', '.join(map(str, peaks))}")
        if "peak_allocated_bytes" in per_rank:
            parts.append(
                "allocator peak (MiB): " + ", ".join(f"rank{r} {b / 2**20:.1f}" for r, b in enumerate(allocated))
            )
        if "peak_kv_bytes" in per_rank:
            parts.append("peak K/V context (MiB): " + ", ".join(f"rank{r} {b / 2**20:.1f}" for r, b in enumerate(kv)))
        if bubbles:
            parts.append("bubble ratio: " + ", ".join(f"rank{r} {x:.4f}" for r, x in enumerate(bubbles)))
            parts.append(f"pipeline: {max(ends):.1f} ms")
        if parts:
            logger.info(f"step: {step:2}  " + "  ".join(parts))
        settings = self.settings
        if settings.sequence_pipeline.pipeline_timeline and timeline.export_due(step, settings.profiling):
            name = settings.schedule
            k = settings.sequence_pipeline.num_subsequences if name in SEQUENCE_SCHEDULES else 1
            loggers = getattr(self.logger, "_loggers", [])  # torchtitan's LoggerContainer
            writers = [lg.writer for lg in loggers if isinstance(lg, TensorBoardLogger)]
            folder = settings.dump_folder / settings.profiling.save_traces_folder
            timeline.export_timeline(step, name, k, folder, writers)

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        """torchtitan's validation metrics, with the pipeline's last-stage loss on every rank.

        Args:
            loss: this rank's validation loss; negative (-1 over the token count) on ranks without the
                pipeline's last stage.
            step: the training step validated at.
            extra_metrics: further metrics to log, by TensorBoard tag.
        """
        # torchtitan's validator gives the ranks without the pipeline's last stage -1 (over
        # the token count) as their loss: every rank logs the last stage's, as in training.
        if self.parallel_dims.pp_enabled:
            value = torch.tensor(float(loss), dtype=torch.float64, device=self.device_memory_monitor.device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.parallel_dims.get_mesh("pp").get_group())
            loss = value.item()
        super().log_validation(loss, step, extra_metrics)
