"""The job check's rules that hold under every torchtitan version, on plain values.

torchtitan 0.2.2 (:mod:`torchtitan_seq.titan.v022.job_check`) and 0.3 (:mod:`torchtitan_seq.titan.v03.job_check`)
describe a job with different configs but the same parallelism fields, and refuse the same
compositions with the same line: each rule here raises ``ValueError`` with one line naming the
setting at fault and the fix, and imports no torchtitan.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES, ScheduleShape
from torchtitan_seq.titan import pipeline_core

__all__ = [
    "check_schedule_name",
    "check_degrees",
    "check_unit_precision",
    "check_compile",
    "check_split_backward_ac",
    "check_instrumentation",
    "check_shape",
]


def check_schedule_name(name: str) -> None:
    """``parallelism.pipeline_parallel_schedule`` names a sequence schedule or one of torch's (torch's
    ``get_schedule_class`` takes its names in any case)."""
    if name not in SEQUENCE_SCHEDULES and name.lower() not in {n.lower() for n in TORCH_SCHEDULES}:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is unknown: use a sequence schedule "
            f"({', '.join(SEQUENCE_SCHEDULES)}) or one of torch's ({', '.join(TORCH_SCHEDULES)})"
        )


def check_degrees(parallelism: Any, world_size: int) -> None:
    """The parallel degrees (``parallelism``'s ``*_degree`` fields) multiply to the process count
    (FSDP's -1 takes what is left)."""
    par = parallelism
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


def check_unit_precision(schedule: str, pp_degree: int, activations: str, why: str, fix: str) -> None:
    """On CUDA a sequence schedule's units (a pipeline: ``pp_degree`` > 1) attend with torch's flash or
    cuDNN op or flash-attn, which take fp16 and bf16 only (``benchmarks/gpu_check.py`` measures it).
    ``activations``: the dtype the version trains the pipeline in, for the reason ``why``; ``fix``: how to
    change it. A CPU job passes (torch's CPU kernel takes float32)."""
    if torch.cuda.is_available() and pp_degree > 1 and activations not in ("bfloat16", "float16"):
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {schedule!r} on CUDA needs bf16 or fp16 activations, but "
            f"{why}, and the CUDA attention kernels take no {activations}: {fix}"
        )


def check_compile(compile_model: bool, *, split_backward: bool, sequence: bool, tp_degree: int, pp_degree: int) -> None:
    """Compiled blocks (``compile_model``: compile.enable with the model among its components) run no
    split backward under a sequence schedule (``sequence``), nor tensor parallelism in a pipeline
    (torch 2.13 to 2.15: tried on each)."""
    if compile_model and split_backward and sequence:
        raise ValueError(
            "sequence_pipeline.split_backward = true cannot run with compile.enable = true: a compiled block is one "
            "autograd node, so the weight pass would run its whole backward again (and torch 2.13 then gets some "
            "weight gradients wrong); use a full backward"
        )
    if compile_model and tp_degree > 1 and pp_degree > 1:
        raise ValueError(
            f"compile.enable = true cannot run with parallelism.tensor_parallel_degree = {tp_degree} in a "
            "pipeline: torch 2.13 to 2.15 hand the compiled blocks' backward plain tensors for DTensors (torch's "
            "1F1B alike); turn one of them off"
        )


def check_split_backward_ac(op_level_sac: bool, *, split_backward: bool, setting: str) -> None:
    """torch's op-level selective AC (``op_level_sac``, named ``setting`` in the version's config)
    allows one backward per checkpointed region, and a split backward runs two."""
    if split_backward and op_level_sac:
        raise ValueError(
            f"sequence_pipeline.split_backward = true cannot run with {setting} (torch's op-level SAC allows "
            "one backward per region): use another AC option or a full backward"
        )


def check_instrumentation(activation_memory_freq: int) -> None:
    """``sequence_pipeline.activation_memory_freq``: every N-th logged step, or never (0)."""
    if activation_memory_freq < 0:
        raise ValueError(
            f"sequence_pipeline.activation_memory_freq = {activation_memory_freq} is negative: use N >= 1 "
            "(every N-th logged step) or 0 (never)"
        )


def check_shape(sequence_pipeline: Any, parallelism: Any, training: Any, model_shape: Any) -> None:
    """The schedule runs the job's shape (:func:`~torchtitan_seq.titan.pipeline_core.job_shape`): the
    sequence cut (k lengths), v chunks per rank, N, p; and the installed torch runs the schedule.

    Args:
        sequence_pipeline: the job's ``[sequence_pipeline]`` section.
        parallelism: its ``parallelism`` section (a sequence schedule named).
        training: its ``training`` section (sequence length, local batch).
        model_shape: the flavor's shape (its layers and heads).
    """
    par, seq = parallelism, sequence_pipeline
    shape = pipeline_core.job_shape(
        seq, par, training, model_shape, par.tensor_parallel_degree, par.pipeline_parallel_degree
    )
    cls = SEQUENCE_SCHEDULES[par.pipeline_parallel_schedule]
    cls.check_torch()
    lists = ScheduleShape(
        par.pipeline_parallel_degree, shape.microbatches, len(shape.lengths), seq.split_backward, shape.stages_per_rank
    )
    cls.check_shape(lists, **cls.options_from_config(seq))
