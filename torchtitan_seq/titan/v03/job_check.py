"""The job check under torchtitan 0.3: refuse, before anything is built, a job that would fail on its
ranks or that the test suite does not train under 0.3, each in one line naming the setting and the fix.

What the test suite trains under 0.3 with the sequence schedules: pipeline parallelism alone or with
FSDP2 (``data_parallel_shard_degree``), tensor parallelism and context parallelism (each unit's queries
over the CP ranks, which FSDP spans: :func:`~torchtitan_seq.titan.v03.pipeline.chunk_parallel_dims`),
causal and block-causal flavors, full and
selective activation checkpointing, torch.compile of the blocks, 0.3's metrics (console, TensorBoard)
and 0.2.2's record beside them (``metrics.jsonl``, the pipeline timeline). The rules 0.2.2 has for
these compositions hold here too (:mod:`torchtitan_seq.titan.job_rules`).
Also replicated data parallelism (HSDP: ``data_parallel_replicate_degree``, alone or with FSDP2's shards),
memory-budget AC (compiled blocks) and the validator
(:class:`~torchtitan_seq.titan.v03.validate.SeqValidator`, neither under CP nor with BSIPipe). Refused with a
sequence schedule, as untested under 0.3: gpt-oss with TP, whose experts' output bias 0.3 adds on every TP
rank under its spmd_types backend. A sequence schedule runs the model specs of
:func:`~torchtitan_seq.titan.v03.model.sequence_model_spec` alone (chunk-aware attention; a family's own spec
has none), and no job pipelines a flavor whose output layer is tied to its embeddings, which 0.3 refuses.
torch's own schedules get those flavor checks and 0.3's own. Context parallelism runs inside a sequence
pipeline only (0.3's own CP of whole sequences, under torch's schedules or without a pipeline, hands the
chunk-aware attention K/V it does not take), and not with MoE layers or torch.compile yet.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import DATASETS

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.titan import job_rules
from torchtitan_seq.titan.data import DATASET_NAME, VALIDATION_DATASET_NAME
from torchtitan_seq.titan.flavors import model_shape
from torchtitan_seq.titan.v03.model import FLAVORS, SEQUENCE_MODELS, family_of
from torchtitan_seq.titan.v03.validate import SeqValidator

__all__ = ["check_job"]

_FIX = "not tested with the sequence schedules under torchtitan 0.3 yet (torchtitan 0.2.2 composes it)"


def check_job(config: Any, world_size: int) -> None:
    """Reject a torchtitan 0.3 job that cannot run on ``world_size`` processes, before anything is built.

    Every job gets the schedule name, the parallel degrees, the flavor and its weight tying checked, and a
    chunk-aware model its context parallelism; a sequence schedule also gets its model's attention, the
    rules of :mod:`torchtitan_seq.titan.job_rules` and the refusals the module docstring lists.

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
    _check_context_parallel(config)
    if name in SEQUENCE_SCHEDULES and not hasattr(config, "sequence_pipeline"):
        raise ValueError(
            f"pipeline_parallel_schedule = {name!r} with a {type(config).__qualname__}, which has no sequence_pipeline "
            "section: use a job of torchtitan_seq.recipes (--module torchtitan_seq.recipes) or a SeqTrainer.Config"
        )
    if name in SEQUENCE_SCHEDULES:
        _check_sequence_job(config)
    _check_datasets(config)  # last: a setting at odds with another is the likelier fault


def _check_datasets(config: Any) -> None:
    """The datasets the job reads (:func:`~torchtitan_seq.titan.job_rules.check_dataset`)."""
    paths = {name: d.path for name, d in DATASETS.items()}
    sections = [("dataloader", config.dataloader, DATASET_NAME)]
    if config.validator.enable:
        sections.append(("validator.dataloader", config.validator.dataloader, VALIDATION_DATASET_NAME))
    for section, loader, shipped in sections:
        job_rules.check_dataset(f"{section}.dataset", loader.dataset, loader.dataset_path, paths, shipped)


def _check_context_parallel(config: Any) -> None:
    """CP with a chunk-aware model (``<family>_seq``) is a sequence pipeline's own, inside each unit, head-tail
    balanced (:mod:`torchtitan_seq.runtime.context_parallel`): 0.3's CP of whole sequences (torch's schedules,
    or no pipeline, which 0.3 trains unpipelined) would hand the model's attention K/V gathered over whole
    sequences, which it does not take. MoE models under CP are not checked exact under 0.3 yet."""
    par, spec = config.parallelism, config.model_spec
    if par.context_parallel_degree == 1 or family_of(spec.name) is None:
        return
    name = par.pipeline_parallel_schedule
    cp = f"parallelism.context_parallel_degree = {par.context_parallel_degree} with {spec.name}"
    if name not in SEQUENCE_SCHEDULES or par.pipeline_parallel_degree == 1:
        job = "no pipeline" if name in SEQUENCE_SCHEDULES else f"torch's schedule {name!r}"
        raise ValueError(
            f"{cp} and {job}: 0.3 would run its own CP of whole sequences, which {spec.name}'s chunk-aware "
            "attention does not take; run a sequence schedule on parallelism.pipeline_parallel_degree >= 2 "
            "(it runs CP inside each unit), or set CP to 1"
        )
    if par.context_parallel_load_balancer != "headtail":
        raise ValueError(
            f"parallelism.context_parallel_load_balancer = {par.context_parallel_load_balancer!r} with the sequence "
            f"schedule {name}: it gives each CP rank a chunk from each end of every unit; set it to 'headtail' "
            "(the default)"
        )
    if model_shape(spec.model).moe is not None:
        raise ValueError(
            f"{cp} and the sequence schedule {name}: MoE layers under CP are not checked exact under torchtitan "
            "0.3 yet (the tokens each CP rank routes to each expert are not compared); set CP to 1"
        )


def _check_validator(config: Any) -> None:
    """A sequence schedule validates with :class:`~torchtitan_seq.titan.v03.validate.SeqValidator`, which hands
    it what the trainer does, and without CP (:func:`~torchtitan_seq.titan.job_rules.check_validation`)."""
    validator, par = config.validator, config.parallelism
    name = par.pipeline_parallel_schedule
    job_rules.check_validation(
        validator.enable, setting="validator.enable = true", schedule=name, cp_degree=par.context_parallel_degree
    )
    if validator.enable and not isinstance(validator, SeqValidator.Config):
        raise ValueError(
            f"validator {type(validator).__qualname__} with the sequence schedule {name}: it would hand the schedule "
            "0.3's per-document positions and no document ids; use torchtitan_seq's SeqValidator.Config "
            "(SeqTrainer.Config's default)"
        )


def _check_sequence_job(config: Any) -> None:
    """A sequence schedule's checks: its model's attention, the shared rules, then the compositions
    untested under 0.3, the loss and the job's shape."""
    par, seq = config.parallelism, config.sequence_pipeline
    name = par.pipeline_parallel_schedule
    job_rules.check_family(name, config.model_spec.name, SEQUENCE_MODELS)
    job_rules.check_attention_backend(seq.attention_backend)
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
    job_rules.check_memory_budget(
        isinstance(ac, MemoryBudgetAC.Config),
        compile_model,
        setting="activation-checkpoint:memory-budget",
        others="activation-checkpoint:full, :selective or :none",
    )
    _check_validator(config)
    # setting as the user wrote it: (whether it is on, the fix)
    untested = {
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
    job_rules.check_kv_context(seq.kv_context, config.model_spec.name, config.model_spec.model, compile_model)
    job_rules.check_shape(seq, par, config.training, model_shape(config.model_spec.model))
