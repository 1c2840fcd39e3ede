"""The job check: refuse, before anything is built, a job that would fail on its ranks.

:func:`check_job` runs one named check per concern; each raises ``ValueError`` with one line that
names the setting at fault and the fix. torch's own schedules get the checks that hold for any job
(schedule name, parallel degrees, flavor, compile); a sequence schedule gets its own too.
"""

from __future__ import annotations

import importlib.util

import torch
from torchtitan.config import JobConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.titan.data import DATASET_NAME, VALIDATION_DATASET_NAME
from torchtitan_seq.titan.job_rules import (
    check_attention_backend,
    check_compile,
    check_dataset,
    check_degrees,
    check_family,
    check_instrumentation,
    check_kv_context,
    check_memory_budget,
    check_schedule_name,
    check_shape,
    check_split_backward_ac,
    check_unit_precision,
    check_validation,
    check_weight_tying,
)
from torchtitan_seq.titan.v022.models.train_specs import ALIASES, FLEX_FAMILIES, SEQUENCE_FAMILIES
from torchtitan_seq.titan.v022.pipeline import pipeline_sequence_llm

__all__ = ["check_job"]


def check_job(job_config: JobConfig, world_size: int) -> None:
    """Reject a torchtitan 0.2.2 job that cannot run on ``world_size`` processes, before anything is built.

    Every job gets the checks that hold for any schedule: its name, the parallel degrees, DDP, the
    flavor, compile, instrumentation and converters; a sequence schedule also gets its model, attention
    backend, precision, microbatches, validation, activation checkpointing, documents, context
    parallelism and shape; torch's schedules get the accelerator and torchtitan's CP. The datasets come
    last: a setting at odds with another is the likelier fault.

    Args:
        job_config: the job's config, its ``[sequence_pipeline]`` section included.
        world_size: the job's process count.

    Raises:
        ValueError: the first check that fails, in one line naming the setting at fault and the fix.
    """
    name = job_config.parallelism.pipeline_parallel_schedule
    check_schedule_name(name)
    check_degrees(job_config.parallelism, world_size)
    _check_replicate(job_config, world_size)
    spec = get_train_spec(job_config.model.name)
    _check_flavor(job_config, spec)
    _check_weight_tying(job_config, spec)
    _check_block_dtype(job_config, world_size)
    _check_compile(job_config)
    check_instrumentation(job_config.sequence_pipeline.activation_memory_freq)
    _check_converters(job_config)
    if name in SEQUENCE_SCHEDULES:
        _check_sequence_model(job_config, spec)
        check_attention_backend(job_config.sequence_pipeline.attention_backend)
        _check_cuda_precision(job_config, world_size)
        n_microbatches = _check_microbatches(job_config)
        _check_validation(job_config, n_microbatches)
        _check_activation_checkpointing(job_config)
        _check_documents(job_config, spec)
        _check_context_parallel(job_config)
        if job_config.parallelism.pipeline_parallel_degree == 1:
            _check_torch_context_parallel(job_config, spec)
        _check_shape(job_config, spec)
    else:
        _check_torch_accelerator(job_config)
        _check_torch_context_parallel(job_config, spec)
    _check_datasets(job_config)  # last: a setting at odds with another is the likelier fault


def _check_flavor(job_config: JobConfig, spec: TrainSpec) -> None:
    """``model.flavor`` is one of the train spec's flavors."""
    flavor = job_config.model.flavor
    if flavor not in spec.model_args:
        raise ValueError(
            f"model.flavor = {flavor!r} is not a flavor of model.name = {job_config.model.name!r}: "
            f"use one of {', '.join(spec.model_args)}"
        )


def _check_weight_tying(job_config: JobConfig, spec: TrainSpec) -> None:
    """A pipeline cannot tie the output layer to the embeddings
    (:func:`~torchtitan_seq.titan.job_rules.check_weight_tying`)."""
    model = job_config.model
    tied = getattr(spec.model_args[model.flavor], "enable_weight_tying", False)
    check_weight_tying(model.name, model.flavor, tied, job_config.parallelism.pipeline_parallel_degree)


def _compiles_model(job_config: JobConfig) -> bool:
    """Whether the job compiles the model's blocks (``compile.enable`` with ``"model"`` among the components)."""
    return job_config.compile.enable and "model" in job_config.compile.components


def _check_compile(job_config: JobConfig) -> None:
    """torchtitan's memory-budget AC is a compile pass; compiled blocks run no split backward
    (:func:`~torchtitan_seq.titan.job_rules.check_compile`)."""
    par, ac = job_config.parallelism, job_config.activation_checkpoint
    compile_model = _compiles_model(job_config)
    check_compile(
        compile_model,
        split_backward=job_config.sequence_pipeline.split_backward,
        sequence=par.pipeline_parallel_schedule in SEQUENCE_SCHEDULES,
        tp_degree=par.tensor_parallel_degree,
    )
    check_memory_budget(
        ac.mode == "memory_budget",
        compile_model,
        setting="activation_checkpoint.mode = 'memory_budget'",
        others="activation_checkpoint.mode 'full', 'selective' or 'none'",
    )


def _check_converters(job_config: JobConfig) -> None:
    """torchtitan's quantizing converters (float8, MX) import torchao, and float8 runs on SM89 GPUs or,
    emulated and eager, anywhere; MX on CUDA only."""
    converters = job_config.model.converters
    if not converters:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(
            f"model.converters = {converters} need torchao, which is not installed: pip install torchao, or "
            "clear model.converters"
        )
    if torch.cuda.is_available():
        return
    compiled = _compiles_model(job_config)
    for name in converters:
        emulated = name == "quantize.linear.float8" and job_config.quantize.linear.float8.emulate and not compiled
        if not emulated:
            raise ValueError(
                f"model.converters = {converters}: {name!r} needs a CUDA GPU (SM89 or newer for float8); on a CPU "
                "only quantize.linear.float8 runs, with quantize.linear.float8.emulate = true and compile off"
            )


def _check_datasets(job_config: JobConfig) -> None:
    """The datasets the job reads (:func:`~torchtitan_seq.titan.job_rules.check_dataset`)."""
    paths = {name: d.path for name, d in DATASETS.items()}
    check_dataset(
        "training.dataset", job_config.training.dataset, job_config.training.dataset_path, paths, DATASET_NAME
    )
    val = job_config.validation
    if val.enable:
        check_dataset("validation.dataset", val.dataset, val.dataset_path, paths, VALIDATION_DATASET_NAME)


def _check_sequence_model(job_config: JobConfig, spec: TrainSpec) -> None:
    """A sequence schedule needs chunk-aware attention, and runs DeepSeek-V3, Llama 4 and gpt-oss in the
    compositions checked exact for them (tests/exactness/test_families.py)."""
    name, par = job_config.model.name, job_config.parallelism
    check_family(par.pipeline_parallel_schedule, name, (*SEQUENCE_FAMILIES, *ALIASES))
    if name not in FLEX_FAMILIES:
        return
    job = f"model.name = {name!r} with the sequence schedule {par.pipeline_parallel_schedule}"
    if name == "deepseek_v3" and par.tensor_parallel_degree > 1:
        raise ValueError(
            f"{job} cannot run with parallelism.tensor_parallel_degree = {par.tensor_parallel_degree}: under "
            "torchtitan 0.2.2's TP plan its router's gradient comes out wrong (its scores multiply the experts' "
            "partial outputs, score_before_experts = false); use FSDP (data_parallel_shard_degree) instead"
        )
    if name == "gpt_oss" and job_config.sequence_pipeline.split_backward:
        raise ValueError(
            f"{job} cannot run with sequence_pipeline.split_backward = true yet: the weight pass gets its "
            "router's bias gradient wrong; use a full backward"
        )
    if par.context_parallel_degree > 1:
        raise ValueError(
            f"{job} cannot run with parallelism.context_parallel_degree = {par.context_parallel_degree} yet: not "
            "checked exact (torchtitan 0.2.2 trains gpt-oss and flex flavors without CP); turn CP off"
        )
    if _compiles_model(job_config):
        raise ValueError(f"{job} cannot run with compile.enable = true yet: not checked exact; turn compile off")


def _check_block_dtype(job_config: JobConfig, world_size: int) -> None:
    """torchtitan 0.2.2's gpt-oss holds its blocks in bfloat16 and its embeddings and output in float32
    (``GptOssModel.__init__``): only FSDP's mixed precision, which casts every parameter to one dtype,
    makes the two meet; without FSDP its first block refuses float32 input, under any schedule. A seed
    checkpoint (one process, no step) is written without one."""
    par = job_config.parallelism
    if job_config.checkpoint.create_seed_checkpoint:
        return
    others = par.data_parallel_replicate_degree * par.context_parallel_degree * par.tensor_parallel_degree
    shard = par.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // (others * par.pipeline_parallel_degree)
    if job_config.model.name == "gpt_oss" and shard < 2:
        raise ValueError(
            f"model.name = 'gpt_oss' needs FSDP (parallelism.data_parallel_shard_degree = {shard}): torchtitan "
            "0.2.2 holds its blocks in bfloat16 and its embeddings in float32, which only FSDP's mixed precision "
            "reconciles; set data_parallel_shard_degree to 2 or more"
        )


def _check_torch_accelerator(job_config: JobConfig) -> None:
    """torchtitan registers its expert-parallel overlap callback with torch's DualPipeV, and the callback
    asks for accelerator streams."""
    par = job_config.parallelism
    dual_pipe = par.pipeline_parallel_schedule.lower() == "dualpipev"
    if dual_pipe and par.pipeline_parallel_expert_parallel_overlap and not torch.cuda.is_available():
        raise ValueError(
            "parallelism.pipeline_parallel_schedule = 'DualPipeV' on a CPU needs "
            "parallelism.pipeline_parallel_expert_parallel_overlap = false: torchtitan's overlap callback runs on "
            "accelerator streams; set it false, or use another schedule"
        )


def _fsdp_degree(parallelism, world_size: int) -> int:
    """The ranks torchtitan 0.2.2's FSDP shards over, the data-parallel shard ranks times the CP ranks:
    1 is no FSDP, so no cast of the parameters to ``training.mixed_precision_param``."""
    par = parallelism
    fixed = par.data_parallel_replicate_degree * par.tensor_parallel_degree * par.pipeline_parallel_degree
    return world_size // fixed


def _check_replicate(job_config: JobConfig, world_size: int) -> None:
    """Replicated data parallelism without FSDP is torchtitan 0.2.2's DDP, which it applies only as the
    job's one dimension (its ``parallelize_fn`` raises "DDP has not supported > 1D parallelism")."""
    par = job_config.parallelism
    replicate = par.data_parallel_replicate_degree
    if replicate > 1 and _fsdp_degree(par, world_size) == 1 and replicate != world_size:
        raise ValueError(
            f"parallelism.data_parallel_replicate_degree = {replicate} without FSDP is torchtitan's DDP, which "
            "runs only alone (not with pipeline or tensor parallelism): shard as well "
            "(parallelism.data_parallel_shard_degree > 1: HSDP) or set it to 1"
        )


def _check_cuda_precision(job_config: JobConfig, world_size: int) -> None:
    """torchtitan 0.2.2 trains a pipeline in float32 unless FSDP casts the parameters."""
    par, param = job_config.parallelism, job_config.training.mixed_precision_param
    fsdp = _fsdp_degree(par, world_size) > 1
    no_fsdp = "without FSDP torchtitan trains pipelines in float32"
    why = f"training.mixed_precision_param = {param!r}" if fsdp else no_fsdp
    check_unit_precision(
        par.pipeline_parallel_schedule,
        par.pipeline_parallel_degree,
        param if fsdp else "float32",
        why,
        "train in bf16 with FSDP (parallelism.data_parallel_shard_degree or context_parallel_degree > 1 and "
        "training.mixed_precision_param = 'bfloat16'), or use one of torch's schedules",
    )


def _check_microbatches(job_config: JobConfig) -> int:
    """The microbatches a step runs, N; the local batch must be a whole number of them."""
    batch, microbatch = job_config.training.local_batch_size, job_config.parallelism.pipeline_parallel_microbatch_size
    if batch % microbatch:
        raise ValueError(
            f"training.local_batch_size = {batch} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {microbatch}"
        )
    return batch // microbatch


def _check_validation(job_config: JobConfig, n_microbatches: int) -> None:
    """Validation runs the training pipeline: the same sequence cut, whole microbatches; not every schedule
    and not under CP (:func:`~torchtitan_seq.titan.job_rules.check_validation`)."""
    val, name = job_config.validation, job_config.parallelism.pipeline_parallel_schedule
    if not val.enable:
        return
    cp_degree = job_config.parallelism.context_parallel_degree
    check_validation(True, setting="validation.enable = true", schedule=name, cp_degree=cp_degree)
    if val.seq_len != job_config.training.seq_len:
        raise ValueError(
            f"validation.seq_len = {val.seq_len} differs from training.seq_len = {job_config.training.seq_len}, "
            f"but the sequence schedule {name} cuts every sequence as training's: set validation.seq_len "
            "to training.seq_len"
        )
    if val.local_batch_size % n_microbatches:
        raise ValueError(
            f"validation.local_batch_size = {val.local_batch_size} is not a multiple of the "
            f"{n_microbatches} microbatches the sequence schedule {name} runs: make it one"
        )


def _check_activation_checkpointing(job_config: JobConfig) -> None:
    """A split backward runs under no op-level selective AC."""
    ac = job_config.activation_checkpoint
    check_split_backward_ac(
        ac.mode == "selective" and ac.selective_ac_option == "op",
        split_backward=job_config.sequence_pipeline.split_backward,
        setting="activation_checkpoint.mode = 'selective' and selective_ac_option = 'op'",
    )


def _check_documents(job_config: JobConfig, spec: TrainSpec) -> None:
    """An expected document length asks for a block-causal flavor (packed documents)."""
    seq, flavor = job_config.sequence_pipeline, job_config.model.flavor
    if seq.expected_document_length and spec.model_args[flavor].attn_mask_type != "block_causal":
        raise ValueError(
            f"sequence_pipeline.expected_document_length = {seq.expected_document_length} needs a "
            f"block-causal flavor, but model.flavor = {flavor!r} is causal: pick one (e.g. "
            "debugmodel_flex_attn) or set it to 0"
        )


def _check_context_parallel(job_config: JobConfig) -> None:
    """A sequence schedule's CP (:mod:`torchtitan_seq.runtime.context_parallel`) balances each unit head-tail and
    all-gathers its K/V, in eager attention."""
    par, name = job_config.parallelism, job_config.parallelism.pipeline_parallel_schedule
    if par.context_parallel_degree == 1:
        return
    cp = f"parallelism.context_parallel_degree = {par.context_parallel_degree} with the sequence schedule {name}"
    if par.context_parallel_rotate_method != "allgather" or par.context_parallel_load_balancer != "headtail":
        raise ValueError(
            f"{cp} all-gathers each unit's K/V and gives each CP rank a chunk from each end of it: set "
            "parallelism.context_parallel_rotate_method = 'allgather' and context_parallel_load_balancer = "
            "'headtail' (the defaults)"
        )


def _check_torch_context_parallel(job_config: JobConfig, spec: TrainSpec) -> None:
    """torchtitan's own CP (torch's schedules, and any job without a pipeline, which torchtitan trains
    unpipelined) runs torch's ring attention, which has no CPU kernel, and shards flex attention's block
    masks, while llama3_seq's block-causal flavors attend by document ids."""
    par, flavor = job_config.parallelism, job_config.model.flavor
    if par.context_parallel_degree == 1:
        return
    if par.pipeline_parallel_schedule in SEQUENCE_SCHEDULES:  # and no pipeline: torchtitan trains it alone
        job = "parallelism.pipeline_parallel_degree = 1 (no pipeline: torchtitan's own CP)"
        fix = "set parallelism.pipeline_parallel_degree >= 2 (a sequence schedule runs its own CP)"
    else:
        job = f"parallelism.pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r}"
        fix = "use a sequence schedule (they run their own CP)"
    cp = f"parallelism.context_parallel_degree = {par.context_parallel_degree} with {job}"
    if not torch.cuda.is_available():
        ring = "torchtitan's CP runs torch's ring attention, which has no CPU kernel"
        raise ValueError(f"{cp} needs CUDA: {ring}; {fix}")
    block_causal = spec.model_args[flavor].attn_mask_type == "block_causal"
    if block_causal and spec.pipelining_fn is pipeline_sequence_llm:
        raise ValueError(
            f"{cp} and the block-causal model.flavor = {flavor!r}: torchtitan's CP shards flex attention's block "
            f"masks, not the document ids llama3_seq attends by; {fix}, or use a causal flavor"
        )


def _check_shape(job_config: JobConfig, spec: TrainSpec) -> None:
    """The schedule runs the job's shape (:func:`~torchtitan_seq.titan.job_rules.check_shape`) and the model
    has what its K/V context keeps (:func:`~torchtitan_seq.titan.job_rules.check_kv_context`)."""
    model_args = spec.model_args[job_config.model.flavor]
    kv_context = job_config.sequence_pipeline.kv_context
    check_kv_context(kv_context, job_config.model.name, model_args, _compiles_model(job_config))
    check_shape(job_config.sequence_pipeline, job_config.parallelism, job_config.training, model_args)
