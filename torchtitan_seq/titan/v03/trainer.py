"""torchtitan 0.3's Trainer with the ``sequence_pipeline`` section and what sequence schedules need.

0.3 normalises every loss by the step's token count itself (``loss_kwargs``' ``global_valid_tokens``,
per unit here), which is the recipe that makes sums over units exact, so unlike 0.2.2 nothing wraps
the loss. The trainer binds ``sequence_pipeline`` and the model's shape to the pipelining function
(0.3 hands a pipelining function no config section of its own), feeds the model sequence positions
(RoPE at 0..L-1, as under 0.2.2, where 0.3's dataloaders emit per-document positions) and, for the
block-causal flavors, the batch's document ids as ``attention_masks``, and every rank logs the loss.
Under context parallelism a sequence schedule takes whole sequences and shards each unit itself: the
trainer's data processing and its steps' SPMD context (``train_context``) run under the chunks' degrees
(:func:`~.pipeline.chunk_parallel_dims`), without 0.3's CP of whole sequences.
Its metrics processor (:mod:`.metrics`) reports what 0.2.2's does, instrumented as there: saved
activations metered on the steps ``sequence_pipeline.activation_memory_freq`` picks, compute actions
timed on logged steps only, and ``metrics.jsonl`` in the dump folder.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.runtime.documents import document_ids
from torchtitan_seq.schedules import SequenceSchedule
from torchtitan_seq.titan.config import SequencePipeline
from torchtitan_seq.titan.flavors import model_shape
from torchtitan_seq.titan.trainer_steps import InstrumentedSteps
from torchtitan_seq.titan.v03.job_check import check_job
from torchtitan_seq.titan.v03.metrics import SeqMetricsProcessor
from torchtitan_seq.titan.v03.pipeline import chunk_parallel_dims, pipeline_sequence_llm
from torchtitan_seq.titan.v03.validate import SeqValidator

__all__ = ["SeqTrainer"]


class SeqTrainer(InstrumentedSteps, Trainer):
    """0.3's ``Trainer`` for sequence pipelines; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sequence_pipeline: SequencePipeline = field(default_factory=SequencePipeline)
        """How sequence schedules cut and run each microbatch (0.2.2's ``[sequence_pipeline]``)."""
        metrics: SeqMetricsProcessor.Config = field(default_factory=SeqMetricsProcessor.Config)
        """0.3's metrics section; its processor also reports the sequence pipeline (:mod:`.metrics`)."""
        validator: SeqValidator.Config = field(default_factory=SeqValidator.Config)
        """0.3's validator section; its validator hands the model what the trainer does (:mod:`.validate`)."""

    def __init__(self, config: Config) -> None:
        """Check the job, bind the pipelining function's settings, then build it as 0.3 does.

        Args:
            config: the job's config, its ``sequence_pipeline`` section included; its model spec's
                ``pipelining_fn`` is replaced by one bound to that section and the model's shape.

        Raises:
            ValueError: the job cannot run on ``WORLD_SIZE`` processes
                (:func:`~torchtitan_seq.titan.v03.job_check.check_job`).
        """
        check_job(config, int(os.environ["WORLD_SIZE"]))
        self.activation_memory = ActivationMemory()
        spec = config.model_spec
        config.model_spec = dataclasses.replace(
            spec,
            pipelining_fn=functools.partial(
                pipeline_sequence_llm, sequence_pipeline=config.sequence_pipeline, model_shape=model_shape(spec.model)
            ),
        )
        super().__init__(config)
        if self.sequence_context_parallel:
            # 0.3's context with the chunks' SPMD mesh, which has no CP axis for attention to gather over
            self.train_context = dist_utils.get_spmd_context(
                parallel_dims=chunk_parallel_dims(self.parallel_dims),
                spmd_typechecking=config.parallelism.spmd_backend == "spmd_types" and config.debug.spmd_typechecking,
            )
        if isinstance(self.metrics_processor, SeqMetricsProcessor):
            self.metrics_processor.attach(config)
        self.attach_sequence_pipeline()

    @property
    def sequence_context_parallel(self) -> bool:
        """Whether a sequence schedule runs context parallelism (its own, inside each unit)."""
        return self.parallel_dims.cp_enabled and isinstance(getattr(self, "pp_schedule", None), SequenceSchedule)

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """0.3's forward and backward of a step, under the activation meter on the steps that meter.

        Args:
            **kwargs: 0.3's arguments (``input_dict``, ``labels``, ``global_valid_tokens``).

        Returns:
            The step's loss, a scalar (on every pipeline rank under pipeline parallelism).
        """
        with self.metered():
            return super().forward_backward_step(**kwargs)

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """0.3's, without its per-document ``positions`` and with document ids for block-causal flavors.

        Without ``positions`` the model reads RoPE at sequence positions, as under 0.2.2. For a
        block-causal flavor the batch's document ids are the ``attention_masks``, which every stage and
        schedule splits. Under a sequence schedule's context parallelism 0.3's processing runs under the
        chunks' degrees (no CP): every CP rank gets whole sequences, of which it runs a share of each unit.

        Args:
            input_dict: the dataloader's tensors of a batch (a microbatch under pipeline parallelism),
                ``input`` (B, L) token ids among them.
            labels: (B, L) labels.

        Returns:
            0.3's (inputs, labels, extra keyword arguments); for a block-causal flavor the keyword
            arguments hold (B, L) document ids as ``attention_masks``.
        """
        input_dict = {k: v for k, v in input_dict.items() if k != "positions"}
        dims = self.parallel_dims
        if self.sequence_context_parallel:  # 0.3's processing under the degrees the chunks see
            self.parallel_dims = chunk_parallel_dims(dims)
            # 0.3 counts the tokens a rank runs (adding them all below): a CP rank runs 1/c of every unit
            self.ntokens_seen -= labels.numel() - labels.numel() // dims.cp
        try:
            inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        finally:
            self.parallel_dims = dims
        if self.model_config.block_causal:
            extra["attention_masks"] = document_ids(inputs, self.tokenizer.eos_id)
        return inputs, labels, extra

    def pp_forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """0.3's pipelined forward and backward of a step, its loss on every pipeline rank.

        Args:
            **kwargs: 0.3's arguments (``input_dict_mbs``, ``label_mbs``, ``global_valid_tokens``).

        Returns:
            The step's loss, a scalar, on every pipeline rank (:meth:`loss_on_every_rank`).
        """
        return self.loss_on_every_rank(super().pp_forward_backward_step(**kwargs))
