"""Building a sequence pipeline inside torchtitan (the ``pipelining_fn`` of our train spec).

For a sequence schedule it splits the model with torchtitan's own ``pipeline_module_split``
(:func:`split_model`), applies torchtitan's SPMD parallelisms per chunk (CP ranks as FSDP's:
:func:`chunk_parallel_dims`), cuts the sequence as the
job's :class:`~torchtitan_seq.runtime.shape.JobShape` says (:func:`job_shape`) and wraps each chunk in a
:class:`~torchtitan_seq.schedules.stage.SequencePipelineStage`; any other schedule goes to ``pipeline_llm``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import pipeline_parallel as titan_pp
from torchtitan.tools.logging import logger

from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, SequenceSchedule
from torchtitan_seq.titan import pipeline_core

__all__ = ["job_shape", "split_model", "chunk_parallel_dims", "pipeline_sequence_llm"]


def job_shape(job_config: JobConfig, model_args: Any, tp_degree: int, pp_degree: int) -> JobShape:
    """The job's :class:`~torchtitan_seq.runtime.shape.JobShape` under a sequence schedule.

    Args:
        job_config: the job's config (``sequence_pipeline``, ``parallelism``, ``training``).
        model_args: the flavor's model args (any family's, read by :func:`~torchtitan_seq.titan.flavors.model_shape`).
        tp_degree: the tensor-parallel degree.
        pp_degree: p, the pipeline ranks.

    Returns:
        :func:`torchtitan_seq.titan.pipeline_core.job_shape`'s shape of the job.
    """
    return pipeline_core.job_shape(
        job_config.sequence_pipeline, job_config.parallelism, job_config.training, model_args, tp_degree, pp_degree
    )


def split_model(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    name: str,
    device: torch.device,
    module_names: list[list[str]],
    **options: Any,
) -> list[tuple[int, int, nn.Module]]:
    """This rank's model chunks for sequence schedule ``name``, cut by torchtitan's ``pipeline_module_split``.

    The schedule's :meth:`~SequenceSchedule.place_stages` says which stages each rank holds and which
    chunk each runs. torchtitan's ``pipeline_module_split`` hands chunks out in a loop (rank r: r, r + p,
    ...), so they are listed in the order that hands each rank its own.

    Args:
        model: the whole model, on the meta device as torchtitan builds it.
        pp_mesh: the pipeline's device mesh.
        name: the sequence schedule's name.
        device: this rank's device.
        module_names: the module names of each of the model's chunks, in model order.
        **options: the schedule's placement options (``options_from_config``).

    Returns:
        [(stage index, chain length, chunk)] for the stages this rank holds, in the order it holds them.
    """
    p = pp_mesh.size()
    held = SEQUENCE_SCHEDULES[name].place_stages(p, len(module_names), **options)
    looped = [module_names[held[r][i][1]] for i in range(len(held[0])) for r in range(p)]
    _, chunks = titan_pp.pipeline_module_split(model, pp_mesh, "Interleaved1F1B", device, looped)
    return [(stage, len(module_names), chunk) for (stage, _), chunk in zip(held[pp_mesh.get_local_rank()], chunks)]


def chunk_parallel_dims(parallel_dims: ParallelDims) -> ParallelDims:
    """The degrees a sequence schedule's chunks are parallelised with: the job's, with the CP ranks as FSDP's.

    The chunks' parameters are sharded and their gradients summed over data-parallel x CP ranks as
    torchtitan does under CP (same meshes), but attention runs the schedule's own CP inside each unit
    (:mod:`torchtitan_seq.runtime.context_parallel`), not the hooks torchtitan puts on attention layers
    for whole sequences (its ring attention; under flex attention a K/V all-gather of its own). The
    trainer's data processing sees them too, so that torchtitan does not shard whole sequences.

    Args:
        parallel_dims: the job's parallel degrees and meshes.

    Returns:
        ``parallel_dims`` itself without CP; else a shallow copy sharing its meshes, with
        ``dp_shard`` x ``cp`` as ``dp_shard`` and ``cp`` = 1.
    """
    if not parallel_dims.cp_enabled:
        return parallel_dims
    dims = copy.copy(parallel_dims)  # the meshes, built, are shared
    dims.dp_shard, dims.cp = parallel_dims.dp_shard * parallel_dims.cp, 1
    return dims


def pipeline_sequence_llm(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    model_args: Any,
    parallelize_fn: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module],
    loss_fn: Callable[..., torch.Tensor],
) -> tuple[SequenceSchedule, list[nn.Module], bool, bool]:
    """torchtitan 0.2.2's ``pipelining_fn`` contract, for sequence schedules by name and torch's otherwise.

    A schedule that is not a sequence schedule goes to torchtitan's ``pipeline_llm``. A sequence schedule
    logs the job's cut, splits the model into chunks (:func:`split_model`), parallelises each with
    ``parallelize_fn`` under :func:`chunk_parallel_dims` and runs them in sequence pipeline stages.

    Args:
        model: the whole model, on the meta device as torchtitan builds it.
        parallel_dims: the job's parallel degrees and meshes.
        job_config: a job :func:`torchtitan_seq.titan.v022.job_check.check_job` passed.
        device: this rank's device.
        model_args: the flavor's model args.
        parallelize_fn: the train spec's SPMD parallelisation, applied to each chunk.
        loss_fn: the train spec's loss, ``loss_fn(logits, labels)`` on (B / N, L, vocab) logits and
            (B / N, L) labels, returning a scalar.

    Returns:
        (schedule, this rank's model parts, whether it holds the first stage, whether it holds a last
        stage).
    """
    par, cfg = job_config.parallelism, job_config.sequence_pipeline
    name = par.pipeline_parallel_schedule
    if name not in SEQUENCE_SCHEDULES:
        return titan_pp.pipeline_llm(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn)
    shape = job_shape(job_config, model_args, parallel_dims.tp, parallel_dims.pp)
    logger.info(pipeline_core.describe_shape(name, shape, cfg.partition))
    num_stages, names = pipeline_core.chunk_module_names(
        name, shape, par, model_args.n_layers, parallel_dims.pp, titan_pp.generate_llm_fqn_per_model_part
    )
    pp_mesh = parallel_dims.get_mesh("pp")
    chunk_dims = chunk_parallel_dims(parallel_dims)
    result = pipeline_core.build_sequence_schedule(
        name,
        split_model(model, pp_mesh, name, device, names, **SEQUENCE_SCHEDULES[name].options_from_config(cfg)),
        lambda chunk: parallelize_fn(chunk, chunk_dims, job_config),
        shape=shape,
        num_stages=num_stages,
        sequence_pipeline=cfg,
        device=device,
        pp_group=pp_mesh.get_group("pp"),
        cp_group=parallel_dims.get_mesh("cp").get_group() if parallel_dims.cp_enabled else None,
        loss_fn=loss_fn,
    )
    if (layout := result[0].describe()) is not None:
        logger.info(layout)
    return result
