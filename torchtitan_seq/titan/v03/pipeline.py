"""Building a sequence pipeline inside torchtitan 0.3 (the ``pipelining_fn`` of :func:`~.model.sequence_model_spec`).

A sequence schedule's chunks are cut with torchtitan's own ``_split_module`` (one chunk per held stage,
as :meth:`~torchtitan_seq.schedules.SequenceSchedule.place_stages` says), parallelised with 0.3's
``parallelize_fn`` under :func:`chunk_parallel_dims` (CP ranks as FSDP's) and run by
:func:`torchtitan_seq.titan.pipeline_core.build_sequence_schedule`; any other schedule goes to 0.3's
``pipeline_llm``. torchtitan's private names used, both in
``distributed/pipeline_parallel.py``: ``_split_module`` (one chunk by module names: 0.3's public
``pipeline_llm`` builds torch's stages with it, which a sequence schedule cannot run) and
``_generate_llm_fqn_per_model_part`` (the module names per chunk, as ``pipeline_llm`` cuts them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import pipeline_parallel as titan_pp
from torchtitan.tools.logging import logger

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, SequenceSchedule
from torchtitan_seq.titan import pipeline_core
from torchtitan_seq.titan.config import SequencePipeline
from torchtitan_seq.titan.flavors import ModelShape
from torchtitan_seq.titan.titan_internals import llm_fqn_per_model_part, split_module

__all__ = ["chunk_parallel_dims", "pipeline_sequence_llm"]

# The job's ParallelDims (kept, so that its id names it alone) -> its chunks' (chunk_parallel_dims).
_CHUNK_DIMS: dict[int, tuple[ParallelDims, ParallelDims]] = {}


def chunk_parallel_dims(parallel_dims: ParallelDims) -> ParallelDims:
    """The degrees a sequence schedule's chunks run under: the job's, with the CP ranks as FSDP's.

    As under 0.2.2 (:func:`torchtitan_seq.titan.v022.pipeline.chunk_parallel_dims`), parameters are sharded
    and gradients summed over data-parallel x CP ranks, while attention runs the schedule's own CP inside
    each unit (:mod:`torchtitan_seq.runtime.context_parallel`). Under 0.3's ``spmd_types`` backend CP is an
    axis of the SPMD mesh a step runs in: every family's inner attention all-gathers K and V over it (CP of
    whole sequences), which a unit's attention does itself. These degrees have no CP axis, so the chunks are
    parallelised, and the trainer processes data and runs its steps' SPMD context, without 0.3's CP.

    0.3's ``ParallelDims`` keeps the meshes it built for its own degrees, so a shallow copy with other degrees
    would keep the CP axis: these are a ``ParallelDims`` of their own, whose meshes span the same ranks (the
    world mesh unflattens as pp, dp_replicate, dp_shard, cp, tp, so dp_shard x cp ranks are one data-parallel
    shard axis), built once per job's ``ParallelDims``: the pipelining function and the trainer share them,
    as 0.3's FSDP needs a parameter's mesh to be the one it shards over.

    Args:
        parallel_dims: the job's parallel degrees and meshes.

    Returns:
        ``parallel_dims`` itself without CP; else the degrees with ``dp_shard`` x ``cp`` as ``dp_shard`` and
        ``cp`` = 1, their meshes built.
    """
    if not parallel_dims.cp_enabled:
        return parallel_dims
    if id(parallel_dims) not in _CHUNK_DIMS:
        p = parallel_dims
        dims = ParallelDims(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard * p.cp,
            cp=1,
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
            world_size=p.world_size,
            spmd_backend=p.spmd_backend,
        )
        dims.build_mesh()
        _CHUNK_DIMS[id(parallel_dims)] = (parallel_dims, dims)
    return _CHUNK_DIMS[id(parallel_dims)][1]


def pipeline_sequence_llm(
    model: nn.Module,
    *,
    device: torch.device,
    model_config: Any,
    parallelize_fn: Callable[..., nn.Module],
    loss_fn: Callable[..., tuple[torch.Tensor, dict]],
    sequence_pipeline: SequencePipeline,
    model_shape: ModelShape,
    **spmd: Any,
) -> tuple[SequenceSchedule, list[nn.Module], bool, bool]:
    """torchtitan 0.3's ``pipelining_fn`` contract, for sequence schedules by name and torch's otherwise.

    A schedule that is not a sequence schedule goes to 0.3's ``pipeline_llm``. A sequence schedule logs
    the job's cut, cuts one chunk per stage this rank holds, parallelises each under
    :func:`chunk_parallel_dims` and runs them in sequence pipeline stages, each CP rank its share of a unit.

    Args:
        model: the whole model, on the meta device as 0.3 builds it.
        device: this rank's device.
        model_config: the model's config (0.3's contract; read by ``pipeline_llm`` only).
        parallelize_fn: the spec's SPMD parallelisation, applied to each chunk with ``spmd``.
        loss_fn: 0.3's loss, returning (loss, extras); the schedule takes its scalar loss.
        sequence_pipeline: the job's ``sequence_pipeline`` section, which 0.3 does not hand a pipelining
            function (:class:`~torchtitan_seq.titan.v03.trainer.SeqTrainer` binds it).
        model_shape: the model's shape, bound by the trainer likewise.
        **spmd: what 0.3 hands its ``parallelize_fn`` too (``parallel_dims``, ``training``,
            ``parallelism``, ``compile_config``, ``ac_config``, ``dump_folder``).

    Returns:
        (schedule, this rank's model parts, whether it holds the first stage, whether it holds a last
        stage).
    """
    parallel_dims, parallelism = spmd["parallel_dims"], spmd["parallelism"]
    name = parallelism.pipeline_parallel_schedule
    if name not in SEQUENCE_SCHEDULES:
        return titan_pp.pipeline_llm(
            model, **spmd, device=device, model_config=model_config, parallelize_fn=parallelize_fn, loss_fn=loss_fn
        )
    cls = SEQUENCE_SCHEDULES[name]
    shape = pipeline_core.job_shape(
        sequence_pipeline, parallelism, spmd["training"], model_shape, parallel_dims.tp, parallel_dims.pp
    )
    logger.info(pipeline_core.describe_shape(name, shape, sequence_pipeline.partition))
    num_stages, names = pipeline_core.chunk_module_names(
        name, shape, parallelism, model_shape.n_layers, parallel_dims.pp, llm_fqn_per_model_part()
    )
    pp_mesh = parallel_dims.get_mesh("pp")
    held = cls.place_stages(pp_mesh.size(), len(names), **cls.options_from_config(sequence_pipeline))
    chunks = [(stage, len(names), split_module(model, names[chunk])) for stage, chunk in held[pp_mesh.get_local_rank()]]
    chunk_spmd = {**spmd, "parallel_dims": chunk_parallel_dims(parallel_dims)}
    schedule, parts, has_first, has_last = pipeline_core.build_sequence_schedule(
        name,
        chunks,
        lambda chunk: parallelize_fn(chunk, **chunk_spmd),
        shape=shape,
        num_stages=num_stages,
        sequence_pipeline=sequence_pipeline,
        device=device,
        pp_group=pp_mesh.get_group("pp"),
        cp_group=parallel_dims.get_mesh("cp").get_group() if parallel_dims.cp_enabled else None,
        # 0.3's losses return (loss, extras); a schedule sums scalars, as 0.3's own pipeline does.
        loss_fn=lambda *args, **kwargs: loss_fn(*args, **kwargs)[0],
    )
    if (layout := schedule.describe()) is not None:
        logger.info(layout)
    return schedule, parts, has_first, has_last
