"""torchtitan's Trainer with the fixes pipeline-parallel training needs.

Every schedule's loss is normalised by the step's token count before backward
(:class:`~torchtitan_seq.runtime.loss.TokenNormalizedLoss`): torchtitan 0.2.2 divides only the logged loss
under pipeline parallelism, so its gradients are sums over tokens. Sequence schedules need the
normalised recipe to be exact; torch's get it too, so both train alike. Every rank logs the real
loss (not -1). Instrumentation runs only on the steps that report it: saved activations are
metered (:mod:`torchtitan_seq.instrumentation.memory`) on the steps ``[sequence_pipeline] activation_memory_freq``
picks, with no saved-tensor hook on the others, and compute actions are timed
(:mod:`torchtitan_seq.instrumentation.timeline`) on logged steps only. Under context parallelism a sequence schedule
takes whole sequences and shards each unit itself.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torchtitan.config import JobConfig
from torchtitan.train import Trainer

from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.runtime.loss import TokenNormalizedLoss
from torchtitan_seq.schedules import SequenceSchedule
from torchtitan_seq.titan.trainer_steps import InstrumentedSteps
from torchtitan_seq.titan.v022.job_check import check_job
from torchtitan_seq.titan.v022.pipeline import chunk_parallel_dims

__all__ = ["SeqTrainer"]


class SeqTrainer(InstrumentedSteps, Trainer):
    """torchtitan's ``Trainer`` for sequence pipelines; see the module docstring."""

    def __init__(self, job_config: JobConfig) -> None:
        """Check the job, then build it as torchtitan does, with the sequence pipeline attached.

        Args:
            job_config: the job's config, its ``[sequence_pipeline]`` section included.

        Raises:
            ValueError: the job cannot run on ``WORLD_SIZE`` processes
                (:func:`~torchtitan_seq.titan.v022.job_check.check_job`).
        """
        check_job(job_config, int(os.environ["WORLD_SIZE"]))
        self.activation_memory = ActivationMemory()
        super().__init__(job_config)
        self.attach_sequence_pipeline()

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """torchtitan's, except that under context parallelism a sequence schedule gets whole sequences.

        The schedule gives each CP rank a share of every unit (:mod:`torchtitan_seq.runtime.context_parallel`),
        where torchtitan would shard whole sequences (and their RoPE positions) before the pipeline cuts them.

        Args:
            input_dict: the dataloader's tensors, ``input`` (B, S) token ids among them.
            labels: (B, S) labels.

        Returns:
            torchtitan's (inputs, labels, extra inputs, extra keyword arguments); for a block-causal
            flavor the keyword arguments hold (B, S) document ids as ``attention_masks``.
        """
        if not (self.parallel_dims.cp_enabled and isinstance(getattr(self, "pp_schedule", None), SequenceSchedule)):
            return super().post_dataloading_process(input_dict, labels)
        # torchtitan's own processing with its CP off for the call: the degrees the chunks see
        dims, self.parallel_dims = self.parallel_dims, chunk_parallel_dims(self.parallel_dims)
        try:
            return super().post_dataloading_process(input_dict, labels)
        finally:
            self.parallel_dims = dims

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        """torchtitan's forward and backward of a step, under the activation meter on the steps that meter.

        Under pipeline parallelism every schedule's losses are normalised by ``global_valid_tokens``
        before backward (the train spec's :class:`~torchtitan_seq.runtime.loss.TokenNormalizedLoss`),
        and every pipeline rank gets the step's loss.

        Args:
            input_dict: the dataloader's tensors, ``input`` (B, S) token ids among them.
            labels: (B, S) labels.
            global_valid_tokens: the step's token count over data-parallel ranks, a scalar.

        Returns:
            The step's loss, a scalar: the sum of token losses over ``global_valid_tokens``.

        Raises:
            TypeError: under pipeline parallelism, a loss that is no ``TokenNormalizedLoss``.
        """
        with self.metered():
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
        return self.loss_on_every_rank(loss)
