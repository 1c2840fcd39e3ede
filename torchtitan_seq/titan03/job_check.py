"""The job check under torchtitan 0.3: refuse, before anything is built, a job that would fail on its
ranks or that no test has run, each in one line naming the setting and the fix.

What 0.3 runs with the sequence schedules today (tests/titan03/): pipeline parallelism alone, causal
and block-causal flavors, no activation checkpointing, no torch.compile, 0.3's own metrics
(console, TensorBoard). The rest of 0.2.2's compositions (FSDP2, TP, CP, AC, compile) and its
metrics record are refused here until they are tested under 0.3; torch's own schedules get 0.3's
checks alone.
"""

from __future__ import annotations

import math
from typing import Any

from torchtitan.components.loss import CrossEntropyLoss

from .. import pipeline_core
from ..flavors import flavor_shapes
from ..schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES, ScheduleShape
from .model import FLAVORS

__all__ = ["check_job"]

_FIX = "torchtitan 0.3 runs the sequence schedules on pipeline ranks alone for now (torchtitan 0.2.2 composes it)"


def check_job(config: Any, world_size: int) -> None:
    """Reject a job (0.3's ``SeqTrainer.Config``) that cannot run on ``world_size`` processes."""
    par = config.parallelism
    name = par.pipeline_parallel_schedule
    # torch's get_schedule_class takes its names in any case.
    if name not in SEQUENCE_SCHEDULES and name.lower() not in {n.lower() for n in TORCH_SCHEDULES}:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is unknown: use a sequence schedule "
            f"({', '.join(SEQUENCE_SCHEDULES)}) or one of torch's ({', '.join(TORCH_SCHEDULES)})"
        )
    degrees = {
        f"{dim}_degree": getattr(par, f"{dim}_degree")
        for dim in ("data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel")
    }
    fixed = par.pipeline_parallel_degree * math.prod(d for d in degrees.values() if d != -1)
    if world_size % fixed or (-1 not in degrees.values() and fixed != world_size):
        raise ValueError(
            f"parallelism degrees (pipeline_parallel_degree={par.pipeline_parallel_degree}, "
            + ", ".join(f"{k}={v}" for k, v in degrees.items())
            + f") do not fit {world_size} processes: make their product the process count (NGPU)"
        )
    if config.model_spec.flavor not in FLAVORS:
        raise ValueError(f"model flavor {config.model_spec.flavor!r}: use one of {', '.join(FLAVORS)}")
    if name in SEQUENCE_SCHEDULES:
        _check_sequence_job(config, world_size)


def _check_sequence_job(config: Any, world_size: int) -> None:
    par, seq = config.parallelism, config.sequence_pipeline
    name = par.pipeline_parallel_schedule
    if world_size != par.pipeline_parallel_degree:
        raise ValueError(
            f"{world_size} processes for parallelism.pipeline_parallel_degree = {par.pipeline_parallel_degree}: "
            f"{_FIX}; set the data-parallel, TP and CP degrees to 1 and NGPU to the pipeline degree"
        )
    # setting as the user wrote it: (whether it is on, the fix)
    untested = {
        "compile.enable = true": (config.compile.enable, "turn it off"),
        "activation_checkpoint": (
            config.activation_checkpoint is not None,
            "use the subcommand activation-checkpoint:none",
        ),
        "validator.enable = true": (config.validator.enable, "turn it off"),
        "parallelism.pipeline_parallel_schedule_csv": (bool(par.pipeline_parallel_schedule_csv), "leave it empty"),
        f"parallelism.spmd_backend = {par.spmd_backend!r}": (par.spmd_backend != "spmd_types", "use 'spmd_types'"),
        "parallelism.expert_parallel_degree > 1": (par.expert_parallel_degree > 1, "set it to 1"),
        "training.enable_cpu_offload = true": (config.training.enable_cpu_offload, "turn it off"),
        # 0.2.2's metrics record (metrics.jsonl: activation peaks, bubble ratios, the timeline)
        "sequence_pipeline.activation_memory_freq > 0": (seq.activation_memory_freq > 0, "set it to 0"),
        "sequence_pipeline.pipeline_timeline = true": (seq.pipeline_timeline, "turn it off"),
    }
    for setting, (on, fix) in untested.items():
        if on:
            raise ValueError(f"{setting} with the sequence schedule {name}: {_FIX}; {fix}")
    if type(config.loss) is not CrossEntropyLoss.Config:
        raise ValueError(
            f"loss {type(config.loss).__qualname__} with the sequence schedule {name}: units run the whole "
            "output layer, use CrossEntropyLoss.Config (as torchtitan_seq.recipes do)"
        )
    shape = pipeline_core.job_shape(
        seq, par, config.training, flavor_shapes[config.model_spec.flavor], 1, par.pipeline_parallel_degree
    )
    cls = SEQUENCE_SCHEDULES[name]
    cls.check_torch()
    lists = ScheduleShape(
        par.pipeline_parallel_degree, shape.microbatches, len(shape.lengths), seq.split_backward, shape.stages_per_rank
    )
    cls.check_shape(lists, **cls.options_from_config(seq))
