"""The torchtitan-free half of building a sequence pipeline, shared by each torchtitan version's
pipelining function (0.2.2: :mod:`torchtitan_seq.titan.v022.pipeline`; 0.3: :mod:`torchtitan_seq.titan.v03.pipeline`).

Both versions describe the pipeline with the same ``parallelism`` fields (``pipeline_parallel_*``,
``context_parallel_degree``) and ``training`` fields (``seq_len``, ``local_batch_size``), which these
functions read; splitting the model into chunks and parallelising each is the version's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, SequenceSchedule
from torchtitan_seq.schedules.stage import SequencePipelineStage
from torchtitan_seq.titan.config import SequencePipeline
from torchtitan_seq.titan.flavors import model_shape

__all__ = ["job_shape", "stages_per_rank", "describe_shape", "chunk_module_names", "build_sequence_schedule"]


def stages_per_rank(parallelism: Any, n_layers: int, pp_degree: int) -> int:
    """v, the sequence schedule's model chunks per rank, chosen as torchtitan's ``pipeline_llm`` does.

    torchtitan chooses it inside ``pipeline_llm``, with no function to call: with
    ``parallelism.pipeline_parallel_layers_per_stage`` set, the model is cut into
    ceil((layers + first- and last-stage weights) / layers per stage) stages; otherwise a single-stage
    schedule gets 1 stage per rank and a multi-stage one 2 (the schedule's ``stages_per_rank``).

    Args:
        parallelism: the job's ``parallelism`` section (a sequence schedule named).
        n_layers: the model's transformer layers.
        pp_degree: p, the pipeline ranks.

    Returns:
        v, the stages each pipeline rank holds.

    Raises:
        ValueError: the layers per stage give a stage count the schedule cannot run on p ranks.
    """
    par = parallelism
    name, per_stage = par.pipeline_parallel_schedule, par.pipeline_parallel_layers_per_stage
    cls = SEQUENCE_SCHEDULES[name]
    default = cls.stages_per_rank
    if per_stage is None:
        return default
    weights = n_layers + par.pipeline_parallel_first_stage_less_layers + par.pipeline_parallel_last_stage_less_layers
    num_stages = math.ceil(weights / per_stage)
    cut = f"parallelism.pipeline_parallel_layers_per_stage = {per_stage} cuts the {n_layers} layers into {num_stages}"
    if cls.parameter_copies > 1:
        chunks = pp_degree * default // cls.parameter_copies
        if num_stages != chunks:
            raise ValueError(
                f"{cut} chunks, but {name} runs exactly {chunks} ({default // cls.parameter_copies} per pipeline "
                "rank and direction): change it (or leave it unset)"
            )
        return default
    v = num_stages // pp_degree
    if num_stages % pp_degree or (v > 1) != (default > 1):
        need = "at least 2 stages" if default > 1 else "exactly 1 stage"
        raise ValueError(
            f"{cut} stages, but {name} needs {need} on each of the {pp_degree} pipeline ranks: "
            "change it (or leave it unset)"
        )
    return v


def job_shape(
    sequence_pipeline: SequencePipeline,
    parallelism: Any,
    training: Any,
    model_args: Any,
    tp_degree: int,
    pp_degree: int,
) -> JobShape:
    """The job's :class:`~torchtitan_seq.runtime.shape.JobShape` under a sequence schedule.

    The sequence of ``training.seq_len`` tokens is cut as ``sequence_pipeline`` says, each length a
    multiple fit for TP and CP (``parallelism.context_parallel_degree``); N = local batch / microbatch
    size, and v is :func:`stages_per_rank`'s.

    Args:
        sequence_pipeline: the job's ``[sequence_pipeline]`` section.
        parallelism: its ``parallelism`` section (a sequence schedule named).
        training: its ``training`` section (``seq_len``, ``local_batch_size``).
        model_args: the flavor's model args (any family's, read by
            :func:`~torchtitan_seq.titan.flavors.model_shape`), for the partition's unit cost.
        tp_degree: the tensor-parallel degree.
        pp_degree: p, the pipeline ranks.

    Returns:
        The job's shape: the k subsequence lengths, N microbatches and v stages per rank among them.

    Raises:
        ValueError: the sequence cannot be cut as asked, or the layers per stage do not fit the schedule.
    """
    cfg, par = sequence_pipeline, parallelism
    return JobShape.of_model(
        model_shape(model_args),
        training.seq_len,
        cfg.num_subsequences,
        cfg.partition,
        document_length=cfg.expected_document_length,
        length_multiple=cfg.length_multiple,
        tp=tp_degree,
        cp=par.context_parallel_degree,
        microbatches=training.local_batch_size // par.pipeline_parallel_microbatch_size,
        stages_per_rank=stages_per_rank(par, model_args.n_layers, pp_degree),
    )


def describe_shape(name: str, shape: JobShape, partition: str) -> str:
    """The line the trainer logs for a sequence schedule's cut of the job.

    Args:
        name: the schedule's name.
        shape: the job's shape (:func:`job_shape`).
        partition: ``sequence_pipeline.partition``.

    Returns:
        One line: the microbatches, subsequences, partition and subsequence lengths.
    """
    return (
        f"Sequence pipeline {name}: {shape.microbatches} microbatches x {len(shape.lengths)} "
        f"subsequences, '{partition}' partition, lengths {shape.lengths}"
    )


def chunk_module_names(
    name: str,
    shape: JobShape,
    parallelism: Any,
    n_layers: int,
    pp_degree: int,
    generate: Callable[[int, int, int, int], list[list[str]]],
) -> tuple[int, list[list[str]]]:
    """The pipeline's stage count and the module names of each model chunk, cut as torchtitan cuts.

    A schedule with parameter copies (BSIPipe, Chimera) runs each chunk on as many stages, so it cuts
    the model into stages / copies chunks.

    Args:
        name: the sequence schedule's name.
        shape: the job's shape (:func:`job_shape`): v stages per rank.
        parallelism: the job's ``parallelism`` section; its ``module_fqns_per_model_part``, where set,
            names the chunks' modules.
        n_layers: the model's transformer layers.
        pp_degree: p, the pipeline ranks.
        generate: the version's ``generate_llm_fqn_per_model_part``, called as ``generate(chunks,
            layers, first-stage less layers, last-stage less layers)``.

    Returns:
        (stages in the pipeline, p x v; the module names of each model chunk, in model order).
    """
    num_stages = pp_degree * shape.stages_per_rank
    names = parallelism.module_fqns_per_model_part or generate(
        num_stages // SEQUENCE_SCHEDULES[name].parameter_copies,
        n_layers,
        parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers,
    )
    return num_stages, names


def build_sequence_schedule(
    name: str,
    chunks: list[tuple[int, int, nn.Module]],
    parallelize: Callable[[nn.Module], nn.Module],
    *,
    shape: JobShape,
    num_stages: int,
    sequence_pipeline: SequencePipeline,
    device: torch.device,
    pp_group: Any,
    cp_group: Any,
    loss_fn: Callable[..., torch.Tensor],
) -> tuple[SequenceSchedule, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` result for this rank's model chunks, run by sequence schedule ``name``.

    Each chunk is parallelised by ``parallelize`` and wrapped in a
    :class:`~torchtitan_seq.schedules.stage.SequencePipelineStage` that cuts each microbatch as
    ``shape`` says and attends with the kernel ``sequence_pipeline.attention_backend`` selects, its K/V
    context keeping what ``sequence_pipeline.kv_context`` says (offloaded to host memory with ``kv_offload``).

    Args:
        name: the sequence schedule's name.
        chunks: this rank's chunks, [(stage index, chain length, chunk)], in the order it runs them.
        parallelize: the version's SPMD parallelisation of one chunk (TP, FSDP, compile, AC).
        shape: the job's shape (:func:`job_shape`).
        num_stages: the stages in the pipeline.
        sequence_pipeline: the job's ``[sequence_pipeline]`` section.
        device: this rank's device.
        pp_group: the pipeline's process group.
        cp_group: the context-parallel group; None without CP.
        loss_fn: the per-unit loss, ``loss_fn(logits, labels)`` on (B / N, L, vocab) logits and
            (B / N, L) labels (L / c tokens under CP), returning a scalar.

    Returns:
        (schedule, this rank's parallelised chunks, whether it holds the first stage, whether it holds
        a last stage).
    """
    cls, cfg = SEQUENCE_SCHEDULES[name], sequence_pipeline
    kernel = select_kernel(torch.device(device), cfg.attention_backend)
    shard = ContextShard.of_group(cp_group)
    stages, model_parts = [], []
    for index, chain_length, chunk in chunks:
        model_parts.append(parallelize(chunk))
        stages.append(
            SequencePipelineStage(
                model_parts[-1],
                index,
                num_stages,
                device,
                lengths=shape.lengths,
                kernel=kernel,
                chain_length=chain_length,
                context_shard=shard,
                kv_context=cfg.kv_context,
                kv_offload=cfg.kv_offload,
                group=pp_group,
            )
        )
    schedule = cls(
        stages, shape.microbatches, loss_fn, split_backward=cfg.split_backward, **cls.options_from_config(cfg)
    )
    return schedule, model_parts, any(s.is_first for s in stages), any(s.is_last for s in stages)
