"""Building a sequence pipeline inside torchtitan (the ``pipelining_fn`` of our train spec).

For a sequence schedule it splits the model with torchtitan's own
``pipeline_module_split`` into v chunks per rank (loop placement: rank r holds
stages r, r + p, ...; v = 1 for single-stage schedules), applies torchtitan's
SPMD parallelisms per chunk, cuts the sequence
(:func:`~torchtitan_seq.partition.partition_sequence`) and wraps each chunk in
a :class:`~torchtitan_seq.stage.SequencePipelineStage`.
Any other schedule name goes to torchtitan's ``pipeline_llm`` unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class
from torchtitan.distributed.pipeline_parallel import (
    generate_llm_fqn_per_model_part,
    pipeline_llm,
    pipeline_module_split,
)
from torchtitan.tools.logging import logger

from .attention import select_kernel
from .partition import UnitCost, partition_sequence
from .schedules import SEQUENCE_SCHEDULES, SequenceSchedule
from .stage import SequencePipelineStage

__all__ = ["check_schedule_name", "sequence_lengths", "stages_per_rank", "pipeline_sequence_llm"]


def check_schedule_name(name: str) -> None:
    """Fail early, naming the setting, on a schedule that is neither ours nor torch's."""
    if name in SEQUENCE_SCHEDULES:
        return
    try:
        get_schedule_class(name)
    except ValueError:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is unknown: use a sequence "
            f"schedule ({', '.join(SEQUENCE_SCHEDULES)}) or one of torch's (1F1B, "
            "Interleaved1F1B, GPipe, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"
        ) from None


def sequence_lengths(job_config, model_args, tp_degree: int) -> list[int]:
    """Subsequence lengths for the job: ``[sequence_pipeline]`` over ``training.seq_len``."""
    cfg = job_config.sequence_pipeline
    return partition_sequence(
        job_config.training.seq_len,
        cfg.num_subsequences,
        cfg.partition,
        multiple=math.lcm(cfg.length_multiple, tp_degree),
        cost=UnitCost.from_model_args(model_args),
    )


def stages_per_rank(job_config, model_args, pp_degree: int) -> int:
    """v, the sequence schedule's model chunks per rank, chosen as torchtitan's ``pipeline_llm`` does.

    With ``parallelism.pipeline_parallel_layers_per_stage`` set, the model is
    cut into ceil((layers + first- and last-stage weights) / layers per stage)
    stages; otherwise a single-stage schedule gets 1 stage per rank and a
    multi-stage one 2. (torchtitan 0.2.2 computes this inside ``pipeline_llm``,
    with no function to call.)
    """
    par = job_config.parallelism
    name = par.pipeline_parallel_schedule
    default = SEQUENCE_SCHEDULES[name].stages_per_rank
    per_stage = par.pipeline_parallel_layers_per_stage
    if per_stage is None:
        return default
    num_stages = math.ceil(
        (
            model_args.n_layers
            + par.pipeline_parallel_first_stage_less_layers
            + par.pipeline_parallel_last_stage_less_layers
        )
        / per_stage
    )
    v = num_stages // pp_degree
    if num_stages % pp_degree or (v > 1) != (default > 1):
        need = "at least 2 stages" if default > 1 else "exactly 1 stage"
        raise ValueError(
            f"parallelism.pipeline_parallel_layers_per_stage = {per_stage} cuts the "
            f"{model_args.n_layers} layers into {num_stages} stages, but {name} needs {need} "
            f"on each of the {pp_degree} pipeline ranks: change it (or leave it unset)"
        )
    return v


def pipeline_sequence_llm(
    model: nn.Module,
    parallel_dims,
    job_config,
    device: torch.device,
    model_args,
    parallelize_fn,
    loss_fn,
) -> tuple[SequenceSchedule, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` contract: (schedule, model parts, has first, has last stage).

    The job is assumed checked (:func:`torchtitan_seq.trainer.check_job`).
    """
    par = job_config.parallelism
    name = par.pipeline_parallel_schedule
    if name not in SEQUENCE_SCHEDULES:
        return pipeline_llm(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn)
    n_microbatches = job_config.training.local_batch_size // par.pipeline_parallel_microbatch_size
    lengths = sequence_lengths(job_config, model_args, parallel_dims.tp)
    cfg = job_config.sequence_pipeline
    logger.info(
        f"Sequence pipeline {name}: {n_microbatches} microbatches x {len(lengths)} "
        f"subsequences, '{cfg.partition}' partition, lengths {lengths}"
    )

    pp_mesh = parallel_dims.get_mesh("pp")
    names = par.module_fqns_per_model_part or generate_llm_fqn_per_model_part(
        parallel_dims.pp * stages_per_rank(job_config, model_args, parallel_dims.pp),
        model_args.n_layers,
        par.pipeline_parallel_first_stage_less_layers,
        par.pipeline_parallel_last_stage_less_layers,
    )
    # torchtitan's split does the module surgery and reads only the stage
    # placement from the schedule name (loop, for any stage count); its stages
    # are torch's and are replaced below by sequence stages over the same chunks.
    torch_stages, model_parts = pipeline_module_split(model, pp_mesh, "Interleaved1F1B", device, names)
    kernel = select_kernel(torch.device(device), cfg.attention_backend)
    stages = []
    for i, (torch_stage, part) in enumerate(zip(torch_stages, model_parts)):
        model_parts[i] = parallelize_fn(part, parallel_dims, job_config)
        stages.append(
            SequencePipelineStage(
                model_parts[i],
                torch_stage.stage_index,
                torch_stage.num_stages,
                device,
                lengths=lengths,
                kernel=kernel,
                group=pp_mesh.get_group("pp"),
            )
        )
    schedule = SEQUENCE_SCHEDULES[name](
        stages, n_microbatches, loss_fn, split_backward=cfg.split_backward
    )
    return (
        schedule,
        model_parts,
        any(s.is_first for s in stages),
        any(s.is_last for s in stages),
    )
