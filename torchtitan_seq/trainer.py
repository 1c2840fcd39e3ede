"""torchtitan's Trainer with the fixes pipeline-parallel training needs, and the job check.

Every schedule's loss is normalised by the step's token count before backward
(:class:`~torchtitan_seq.loss.TokenNormalizedLoss`): torchtitan 0.2.2 divides only the logged loss
under pipeline parallelism, so its gradients are sums over tokens. Sequence schedules need the
normalised recipe to be exact; torch's get it too, so both train alike. Every rank logs the real
loss (not -1), and saved activations are measured per step (:mod:`torchtitan_seq.memory`).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor
from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.train import Trainer

from . import cpu_compat
from .loss import TokenNormalizedLoss
from .memory import ActivationMemory
from .metrics import SeqMetricsProcessor
from .pipeline import pipeline_sequence_llm, sequence_lengths, stages_per_rank
from .schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES, BidirectionalSchedule, SequenceSchedule

__all__ = ["SeqTrainer", "check_job"]


def check_job(job_config: JobConfig, world_size: int) -> None:
    """Reject, before anything is built, a job that cannot run on ``world_size`` processes; each
    one-line message names the setting at fault."""
    par, seq, ac = job_config.parallelism, job_config.sequence_pipeline, job_config.activation_checkpoint
    name, flavor = par.pipeline_parallel_schedule, job_config.model.flavor
    if name not in SEQUENCE_SCHEDULES:
        try:
            get_schedule_class(name)
        except ValueError:
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule = {name!r} is unknown: use a sequence schedule "
                f"({', '.join(SEQUENCE_SCHEDULES)}) or one of torch's ({', '.join(TORCH_SCHEDULES)})"
            ) from None
    degrees = {
        f"{dim}_degree": getattr(par, f"{dim}_degree")
        for dim in ("data_parallel_replicate", "context_parallel", "tensor_parallel", "pipeline_parallel")
    }
    fixed, shard = math.prod(degrees.values()), par.data_parallel_shard_degree
    if world_size % fixed or (shard != -1 and fixed * shard != world_size):
        product = " x ".join(f"{k}={v}" for k, v in {**degrees, "data_parallel_shard_degree": shard}.items())
        raise ValueError(
            f"parallelism degrees {product} do not fit {world_size} processes: set them (e.g. "
            "parallelism.pipeline_parallel_degree) so that their product is the process count, or change "
            "the process count (NGPU)"
        )
    spec = get_train_spec(job_config.model.name)
    if flavor not in spec.model_args:
        raise ValueError(
            f"model.flavor = {flavor!r} is not a flavor of model.name = {job_config.model.name!r}: "
            f"use one of {', '.join(spec.model_args)}"
        )
    # torchtitan's memory-budget AC is a compile pass; compiled blocks run no split backward, nor
    # tensor parallelism in a pipeline (torch 2.13).
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if compile_model and seq.split_backward and name in SEQUENCE_SCHEDULES:
        raise ValueError(
            "sequence_pipeline.split_backward = true cannot run with compile.enable = true: a compiled block is one "
            "autograd node, so the weight pass would run its whole backward again (and torch 2.13 then gets some "
            "weight gradients wrong); use a full backward"
        )
    if compile_model and par.tensor_parallel_degree > 1 and par.pipeline_parallel_degree > 1:
        raise ValueError(
            f"compile.enable = true cannot run with parallelism.tensor_parallel_degree = "
            f"{par.tensor_parallel_degree} in a pipeline: torch 2.13 hands the compiled blocks' backward "
            "plain tensors for DTensors (torch's 1F1B alike); turn one of them off"
        )
    if ac.mode == "memory_budget" and not compile_model:
        raise ValueError(
            "activation_checkpoint.mode = 'memory_budget' needs torch.compile of the model: set "
            "compile.enable = true with 'model' in compile.components, or use activation_checkpoint.mode "
            "'full', 'selective' or 'none'"
        )
    if name not in SEQUENCE_SCHEDULES:
        return
    if spec.pipelining_fn is not pipeline_sequence_llm:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} needs a model with chunk-aware attention, "
            f'but model.name = {job_config.model.name!r} has none: set [model] name = "llama3_seq"'
        )
    # torchtitan 0.2.2 trains in float32 under pipeline parallelism unless FSDP casts the parameters;
    # torch's CUDA attention kernels (and flash-attn), which units run on, take bf16 and fp16 only.
    low_precision = job_config.training.mixed_precision_param in ("bfloat16", "float16")
    fsdp_casts = world_size // fixed > 1 and low_precision
    if torch.cuda.is_available() and par.pipeline_parallel_degree > 1 and not fsdp_casts:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} on CUDA needs bf16 or fp16 activations, but without "
            "FSDP (parallelism.data_parallel_shard_degree > 1, with training.mixed_precision_param = 'bfloat16') "
            "torchtitan trains pipelines in float32, which the CUDA attention kernels do not take: shard the data "
            "parallel dimension, or use one of torch's schedules"
        )
    if par.context_parallel_degree > 1:
        raise ValueError(
            f"parallelism.context_parallel_degree = {par.context_parallel_degree} cannot be combined with "
            f"the sequence schedule {name}: both cut the sequence; set it to 1"
        )
    batch, microbatch = job_config.training.local_batch_size, par.pipeline_parallel_microbatch_size
    if batch % microbatch:
        raise ValueError(
            f"training.local_batch_size = {batch} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {microbatch}"
        )
    if seq.split_backward and ac.mode == "selective" and ac.selective_ac_option == "op":
        raise ValueError(
            "sequence_pipeline.split_backward = true cannot run with activation_checkpoint.mode = 'selective' "
            "and selective_ac_option = 'op' (torch's op-level SAC allows one backward per region): use "
            "another AC option or a full backward"
        )
    n_microbatches = batch // microbatch
    # Validation runs the training pipeline: the same sequence cut, whole microbatches.
    val = job_config.validation
    if val.enable and val.seq_len != job_config.training.seq_len:
        raise ValueError(
            f"validation.seq_len = {val.seq_len} differs from training.seq_len = {job_config.training.seq_len}, "
            f"but the sequence schedule {name} cuts every sequence as training's: set validation.seq_len "
            "to training.seq_len"
        )
    if val.enable and val.local_batch_size % n_microbatches:
        raise ValueError(
            f"validation.local_batch_size = {val.local_batch_size} is not a multiple of the "
            f"{n_microbatches} microbatches the sequence schedule {name} runs: make it one"
        )
    model_args = spec.model_args[flavor]
    if seq.expected_document_length and model_args.attn_mask_type != "block_causal":
        raise ValueError(
            f"sequence_pipeline.expected_document_length = {seq.expected_document_length} needs a "
            f"block-causal flavor, but model.flavor = {flavor!r} is causal: pick one (e.g. "
            "debugmodel_flex_attn) or set it to 0"
        )
    stages_per_rank(job_config, model_args, par.pipeline_parallel_degree)
    k = len(sequence_lengths(job_config, model_args, par.tensor_parallel_degree))
    cls = SEQUENCE_SCHEDULES[name]
    if issubclass(cls, BidirectionalSchedule):
        cls.check_torch()
    options = cls.options_from_config(seq)
    cls.check_shape(par.pipeline_parallel_degree, n_microbatches, k, split_backward=seq.split_backward, **options)


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
