"""torchtitan's Trainer with the fixes pipeline-parallel training needs.

* Every schedule's loss is normalised by the step's token count before
  backward (:class:`~torchtitan_seq.loss.TokenNormalizedLoss`): torchtitan
  0.2.2 divides only the logged loss under pipeline parallelism, so its
  gradients are sums over tokens. Sequence schedules need the normalised
  recipe to be exact, and torch's schedules get it too, so both train alike.
* Every rank logs the real loss (the pipeline stage that owns it shares it),
  not -1.
* Saved activations are measured per step (:mod:`torchtitan_seq.memory`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.train import Trainer

from .loss import TokenNormalizedLoss
from .memory import ActivationMemory
from .metrics import SeqMetricsProcessor
from .pipeline import check_schedule_name, pipeline_sequence_llm
from .schedules import SEQUENCE_SCHEDULES

__all__ = ["SeqTrainer"]


def check_job(job_config) -> None:
    """Reject, before anything is built, settings a sequence schedule cannot run with."""
    name = job_config.parallelism.pipeline_parallel_schedule
    check_schedule_name(name)
    if name in SEQUENCE_SCHEDULES:
        spec = get_train_spec(job_config.model.name)
        if spec.pipelining_fn is not pipeline_sequence_llm:
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule = {name!r} needs a model with "
                f"chunk-aware attention, but model.name = {job_config.model.name!r} has none: "
                'set [model] name = "llama3_seq"'
            )


class SeqTrainer(Trainer):
    """torchtitan's ``Trainer`` for sequence pipelines; see the module docstring."""

    def __init__(self, job_config):
        check_job(job_config)
        self.activation_memory = ActivationMemory()
        super().__init__(job_config)
        if isinstance(self.metrics_processor, SeqMetricsProcessor):
            self.metrics_processor.activation_memory = self.activation_memory

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
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
                    input_dict=input_dict,
                    labels=labels,
                    global_valid_tokens=torch.ones((), device=self.device),
                )
        # One pipeline rank owns the loss; the others held -1 and now learn it.
        loss = loss.reshape(()) if self.pp_has_last_stage else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
        return loss
