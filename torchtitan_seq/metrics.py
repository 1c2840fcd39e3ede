"""torchtitan's metrics, plus what sequence pipelines need to show.

Per logged step, every rank's peak activation bytes (measured by
:class:`~torchtitan_seq.memory.ActivationMemory`) join torchtitan's metrics:
in TensorBoard as ``memory/peak_activation_bytes/rank{r}`` and on the
console as one line after torchtitan's step line.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from .memory import ActivationMemory

__all__ = ["SeqMetricsProcessor", "build_seq_metrics_processor"]


class SeqMetricsProcessor(MetricsProcessor):
    """torchtitan's ``MetricsProcessor`` that also reports activation memory per rank."""

    activation_memory: ActivationMemory | None = None

    def _gather_activation_peaks(self) -> list[int]:
        peak = self.activation_memory.peak if self.activation_memory else 0
        local = torch.tensor([peak], dtype=torch.int64, device=self.device_memory_monitor.device)
        if not dist.is_initialized():
            return [peak]
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return [int(t.item()) for t in gathered]

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        peaks = self._gather_activation_peaks()
        metrics = dict(extra_metrics or {})
        metrics.update({f"memory/peak_activation_bytes/rank{r}": b for r, b in enumerate(peaks)})
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=metrics)
        mib = ", ".join(f"rank{r} {b / 2**20:.1f}" for r, b in enumerate(peaks))
        logger.info(f"step: {step:2}  peak activations (MiB): {mib}")


def build_seq_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """torchtitan's ``build_metrics_processor_fn`` contract."""
    return SeqMetricsProcessor(job_config, parallel_dims, tag)
