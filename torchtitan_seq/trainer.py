"""torchtitan's Trainer with the fixes pipeline-parallel training needs.

Every schedule's loss is normalised by the step's token count before backward
(:class:`~torchtitan_seq.loss.TokenNormalizedLoss`): torchtitan 0.2.2 divides only the logged loss
under pipeline parallelism, so its gradients are sums over tokens. Sequence schedules need the
normalised recipe to be exact; torch's get it too, so both train alike. Every rank logs the real
loss (not -1), and saved activations are measured per step (:mod:`torchtitan_seq.memory`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import JobConfig
from torchtitan.train import Trainer

from . import cpu_compat
from .loss import TokenNormalizedLoss
from .memory import ActivationMemory
from .metrics import SeqMetricsProcessor
from .job_check import check_job
from .schedules import SequenceSchedule

__all__ = ["SeqTrainer"]


class SeqTrainer(Trainer):
    """torchtitan's ``Trainer`` for sequence pipelines; see the module docstring."""

    def __init__(self, job_config: JobConfig) -> None:
        check_job(job_config, int(os.environ["WORLD_SIZE"]))
        self.activation_memory = ActivationMemory()
        super().__init__(job_config)
        cpu_compat.fsdp_for_gloo(self.model_parts)
        schedule = getattr(self, "pp_schedule", None)
        if isinstance(schedule, SequenceSchedule):
            # e.g. BSIPipe, Chimera: the optimizer steps each chunk's primary copy; the mirror copy follows.
            self.optimizers.register_step_post_hook(lambda *_: schedule.after_optimizer_step())
        if isinstance(self.metrics_processor, SeqMetricsProcessor):
            self.metrics_processor.activation_memory = self.activation_memory
            self.metrics_processor.record_start(schedule)

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        with self.activation_memory.track():
            if not self.parallel_dims.pp_enabled:
                return super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
                )
            if not isinstance(self.loss_fn, TokenNormalizedLoss):
                raise TypeError("SeqTrainer needs the train spec's TokenNormalizedLoss")
            # The schedule's losses come out normalised, so torchtitan divides by one.
            with self.loss_fn.normalized_by(global_valid_tokens):
                loss = super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=torch.ones((), device=self.device)
                )
        # One pipeline rank owns the loss; the others held -1 and now learn it.
        if isinstance(loss, DTensor):  # loss parallel under TP
            loss = loss.full_tensor()
        loss = loss.detach().reshape(()) if self.pp_has_last_stage else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
        return loss
