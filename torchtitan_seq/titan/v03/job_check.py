"""The job check under torchtitan 0.3: refuse, before anything is built, a job that would fail on its
ranks or that the test suite does not train under 0.3, each in one line naming the setting and the fix.

What the test suite trains under 0.3 with the sequence schedules: pipeline parallelism alone or with
FSDP2 (``data_parallel_shard_degree``) and tensor parallelism, causal and block-causal flavors, full and
selective activation checkpointing, torch.compile of the blocks, 0.3's metrics (console, TensorBoard)
and 0.2.2's record beside them (``metrics.jsonl``, the pipeline timeline). The rules 0.2.2 has for
these compositions hold here too (:mod:`torchtitan_seq.titan.job_rules`).
Refused with a sequence schedule, as untested under 0.3: context parallelism (0.3's ``parallelize_fn``
applies its own CP to whole sequences, where a sequence schedule shards each unit itself and folds the
CP ranks into FSDP's, as 0.2.2's pipelining function and trainer do), replicated data parallelism,
memory-budget AC and the validator; and gpt-oss with TP, whose experts' output bias 0.3 adds on every TP
rank under its spmd_types backend. A sequence schedule runs the model specs of
:func:`~torchtitan_seq.titan.v03.model.sequence_model_spec` alone (chunk-aware attention; a family's own
spec has none), and no job pipelines a flavor whose output layer is tied to its embeddings, which 0.3
refuses. torch's own schedules get those flavor checks and 0.3's own.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC, SelectiveAC

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.titan import job_rules
from torchtitan_seq.titan.flavors import model_shape
from torchtitan_seq.titan.v03.model import FLAVORS, SEQUENCE_MODELS, family_of

__all__ = ["check_job"]

_FIX = "not tested with the sequence schedules under torchtitan 0.3 yet (torchtitan 0.2.2 composes it)"


def check_job(config: Any, world_size: int) -> None:
    """Reject a torchtitan 0.3 job that cannot run on ``world_size`` processes, before anything is built.

    Every job gets the schedule name, the parallel degrees, the flavor and its weight tying checked; a
    sequence schedule also gets its model's attention, the rules of :mod:`torchtitan_seq.titan.job_rules`
    and the refusals the module docstring lists.

    Args:
        config: the job's :class:`~torchtitan_seq.titan.v03.trainer.SeqTrainer` config, its
            ``sequence_pipeline`` section included.
        world_size: the job's process count.

    Raises:
        ValueError: the first check that fails, in one line naming the setting at fault and the fix.
    """
    par = config.parallelism
    name = par.pipeline_parallel_schedule
    job_rules.check_schedule_name(name)
    job_rules.check_degrees(par, world_size)
    spec = config.model_spec
    if (family := family_of(spec.name)) is not None and spec.flavor not in FLAVORS[family]:
        raise ValueError(f"model flavor {spec.flavor!r} of {spec.name}: use one of {', '.join(FLAVORS[family])}")
    job_rules.check_weight_tying(spec.name, spec.flavor, spec.model.enable_weight_tying, par.pipeline_parallel_degree)
    if name in SEQUENCE_SCHEDULES:
        _check_sequence_job(config)


def _check_sequence_job(config: Any) -> None:
    """A sequence schedule's checks: its model's attention, the shared rules, then the compositions
    untested under 0.3, the loss and the job's shape."""
    par, seq = config.parallelism, config.sequence_pipeline
    name = par.pipeline_parallel_schedule
    job_rules.check_family(name, config.model_spec.name, SEQUENCE_MODELS)
    compile_model = config.compile.enable and "model" in config.compile.components
    job_rules.check_compile(
        compile_model, split_backward=seq.split_backward, sequence=True, tp_degree=par.tensor_parallel_degree
    )
    job_rules.check_instrumentation(seq.activation_memory_freq)
    param = config.training.mixed_precision_param
    job_rules.check_unit_precision(
        name,
        par.pipeline_parallel_degree,
        param,
        f"training.mixed_precision_param = {param!r} (0.3's FSDP casts the parameters to it, with or without sharding)",
        "set training.mixed_precision_param = 'bfloat16', or use one of torch's schedules",
    )
    ac = config.activation_checkpoint
    job_rules.check_split_backward_ac(
        isinstance(ac, SelectiveAC.Config),
        split_backward=seq.split_backward,
        setting="activation-checkpoint:selective (0.3's selective AC is op-level)",
    )
    # setting as the user wrote it: (whether it is on, the fix)
    untested = {
        f"parallelism.context_parallel_degree = {par.context_parallel_degree}": (
            par.context_parallel_degree > 1,
            "set it to 1 (0.3 would apply its own CP to whole sequences, not to each unit)",
        ),
        f"parallelism.data_parallel_replicate_degree = {par.data_parallel_replicate_degree}": (
            par.data_parallel_replicate_degree > 1,
            "set it to 1 and shard instead (parallelism.data_parallel_shard_degree)",
        ),
        "activation-checkpoint:memory-budget": (
            isinstance(ac, MemoryBudgetAC.Config),
            "use activation-checkpoint:full, :selective or :none",
        ),
        "validator.enable = true": (config.validator.enable, "turn it off"),
        "parallelism.pipeline_parallel_schedule_csv": (bool(par.pipeline_parallel_schedule_csv), "leave it empty"),
        f"parallelism.spmd_backend = {par.spmd_backend!r}": (par.spmd_backend != "spmd_types", "use 'spmd_types'"),
        "parallelism.expert_parallel_degree > 1": (par.expert_parallel_degree > 1, "set it to 1"),
        "training.enable_cpu_offload = true": (config.training.enable_cpu_offload, "turn it off"),
    }
    for setting, (on, fix) in untested.items():
        if on:
            raise ValueError(f"{setting} with the sequence schedule {name}: {_FIX}; {fix}")
    if family_of(config.model_spec.name) == "gpt_oss" and par.tensor_parallel_degree > 1:
        raise ValueError(
            f"parallelism.tensor_parallel_degree = {par.tensor_parallel_degree} with gpt_oss_seq: under 0.3's "
            "spmd_types backend gpt-oss's experts add their output bias on every TP rank (they look for a DTensor "
            "to find the TP degree), so the job would not train what it trains without TP; set it to 1"
        )
    if type(config.loss) is not CrossEntropyLoss.Config:
        raise ValueError(
            f"loss {type(config.loss).__qualname__} with the sequence schedule {name}: units run the whole "
            "output layer, use CrossEntropyLoss.Config (as torchtitan_seq.recipes do)"
        )
    job_rules.check_shape(seq, par, config.training, model_shape(config.model_spec.model))
