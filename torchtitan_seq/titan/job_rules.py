"""The job check's rules that hold under every torchtitan version, on plain values.

torchtitan 0.2.2 (:mod:`torchtitan_seq.titan.v022.job_check`) and 0.3 (:mod:`torchtitan_seq.titan.v03.job_check`)
describe a job with different configs but the same parallelism fields, and refuse the same
compositions with the same line: each rule here raises ``ValueError`` with one line naming the
setting at fault and the fix, and imports no torchtitan.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import torch

from torchtitan_seq.runtime.torch_internals import ASYNC_COLLECTIVE_REPAIRABLE
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES, ScheduleShape
from torchtitan_seq.titan import pipeline_core
from torchtitan_seq.titan.flavors import model_shape

__all__ = [
    "FAMILY_GAPS",
    "check_family",
    "check_weight_tying",
    "check_schedule_name",
    "check_degrees",
    "check_unit_precision",
    "check_compile",
    "check_split_backward_ac",
    "check_memory_budget",
    "check_validation",
    "check_instrumentation",
    "check_shape",
    "check_kv_context",
    "check_attention_backend",
    "check_dataset",
]


FAMILY_GAPS: dict[str, str] = {
    "gpt_oss": "its attention sinks and sliding windows are not chunk-aware under this torchtitan yet",
    "llama4": "its chunked local attention is not chunk-aware under this torchtitan yet",
    "deepseek_v3": "its multi-head latent attention is not chunk-aware under this torchtitan yet",
}
"""Why torchtitan's LLM families that sequence schedules run under one torchtitan version (0.2.2 runs them
all) but not the installed one cannot, by model name."""


def check_family(schedule: str, model_name: str, families: tuple[str, ...]) -> None:
    """Refuse a sequence schedule for a model without chunk-aware attention.

    Args:
        schedule: ``parallelism.pipeline_parallel_schedule``, a sequence schedule.
        model_name: ``model.name``.
        families: the model names whose attention is chunk-aware under the installed torchtitan.

    Raises:
        ValueError: ``model_name`` is not one of ``families``.
    """
    if model_name not in families:
        why = FAMILY_GAPS.get(model_name, "it has no chunk-aware attention")
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {schedule!r} cannot run model.name = {model_name!r}: "
            f"{why}; use one of {', '.join(families)} (or one of torch's schedules)"
        )


def check_weight_tying(model_name: str, flavor: str, tied: bool, pp_degree: int) -> None:
    """Refuse a pipeline over a flavor whose output layer shares the embeddings' weight (Qwen3's small
    flavors): the first and last stages would each train a copy of their own. torchtitan 0.3 refuses
    the pair too.

    Args:
        model_name: ``model.name``.
        flavor: ``model.flavor``.
        tied: whether the flavor ties them (its ``enable_weight_tying``).
        pp_degree: ``parallelism.pipeline_parallel_degree``.

    Raises:
        ValueError: a tied flavor in a pipeline.
    """
    if tied and pp_degree > 1:
        raise ValueError(
            f"model.flavor = {flavor!r} of model.name = {model_name!r} ties its output layer to the embeddings "
            "(enable_weight_tying), which a pipeline puts on different stages: use a flavor without tied "
            "weights (e.g. debugmodel_moe) or parallelism.pipeline_parallel_degree = 1"
        )


def check_schedule_name(name: str) -> None:
    """Refuse a ``parallelism.pipeline_parallel_schedule`` that is neither a sequence schedule nor torch's.

    Args:
        name: the schedule's name; torch's names match in any case, as torch's ``get_schedule_class``
            takes them.

    Raises:
        ValueError: ``name`` is unknown.
    """
    if name not in SEQUENCE_SCHEDULES and name.lower() not in {n.lower() for n in TORCH_SCHEDULES}:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is unknown: use a sequence schedule "
            f"({', '.join(SEQUENCE_SCHEDULES)}) or one of torch's ({', '.join(TORCH_SCHEDULES)})"
        )


def check_degrees(parallelism: Any, world_size: int) -> None:
    """Refuse parallel degrees whose product is not the process count.

    Args:
        parallelism: the job's ``parallelism`` section; its ``*_degree`` fields are read, and a
            ``data_parallel_shard_degree`` of -1 (FSDP) takes the processes the others leave.
        world_size: the job's process count.

    Raises:
        ValueError: the degrees do not fit ``world_size`` processes.
    """
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
    """Refuse a sequence pipeline on CUDA whose activations are neither bf16 nor fp16.

    On CUDA a sequence schedule's units attend with torch's flash or cuDNN kernel or with flash-attn,
    which take fp16 and bf16 only. A CPU job passes: torch's CPU kernel takes float32.

    Args:
        schedule: the schedule's name, for the message.
        pp_degree: the pipeline degree; 1 runs no pipeline, so no units.
        activations: the dtype the torchtitan version trains the pipeline in.
        why: the reason it trains in that dtype, for the message.
        fix: how to change it, for the message.

    Raises:
        ValueError: a pipeline on CUDA with activations in another dtype.
    """
    if torch.cuda.is_available() and pp_degree > 1 and activations not in ("bfloat16", "float16"):
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {schedule!r} on CUDA needs bf16 or fp16 activations, but "
            f"{why}, and the CUDA attention kernels take no {activations}: {fix}"
        )


def check_compile(compile_model: bool, *, split_backward: bool, sequence: bool, tp_degree: int) -> None:
    """Refuse compiled blocks with a split backward, and with tensor parallelism on a torch the project
    cannot repair.

    A compiled block is one autograd node, so a split backward's weight pass would run its whole
    backward again. Under tensor parallelism torch 2.13 to 2.15 drop the gradient of the first compiled
    block's input (the embedding's reduce-scatter, not yet waited for), with any schedule;
    :func:`~torchtitan_seq.runtime.torch_internals.keep_async_collective_input_grads` repairs it where
    torch has the function it wraps.

    Args:
        compile_model: ``compile.enable`` with the model among its components.
        split_backward: ``sequence_pipeline.split_backward``.
        sequence: whether the job runs a sequence schedule (a split backward is theirs).
        tp_degree: the tensor-parallel degree.

    Raises:
        ValueError: compiled blocks with either.
    """
    if compile_model and split_backward and sequence:
        raise ValueError(
            "sequence_pipeline.split_backward = true cannot run with compile.enable = true: a compiled block is one "
            "autograd node, so the weight pass would run its whole backward again (and torch 2.13 then gets some "
            "weight gradients wrong); use a full backward"
        )
    if compile_model and tp_degree > 1 and not ASYNC_COLLECTIVE_REPAIRABLE:
        raise ValueError(
            f"compile.enable = true cannot run with parallelism.tensor_parallel_degree = {tp_degree} on torch "
            f"{torch.__version__}: its compiled blocks drop the gradient of the embedding's reduce-scatter (torch's "
            "own schedules alike), and torchtitan_seq's repair does not reach this torch; turn one of them off"
        )


def check_split_backward_ac(op_level_sac: bool, *, split_backward: bool, setting: str) -> None:
    """Refuse a split backward under torch's op-level selective activation checkpointing.

    Op-level selective AC allows one backward per checkpointed region, and a split backward runs two.

    Args:
        op_level_sac: whether the job checkpoints with op-level selective AC.
        split_backward: ``sequence_pipeline.split_backward``.
        setting: how the torchtitan version's config names op-level selective AC, for the message.

    Raises:
        ValueError: both are on.
    """
    if split_backward and op_level_sac:
        raise ValueError(
            f"sequence_pipeline.split_backward = true cannot run with {setting} (torch's op-level SAC allows "
            "one backward per region): use another AC option or a full backward"
        )


def check_memory_budget(memory_budget: bool, compile_model: bool, *, setting: str, others: str) -> None:
    """Refuse memory-budget activation checkpointing without torch.compile of the model.

    The budget is a setting of compile's partitioner, which decides what each compiled block recomputes:
    eager blocks would run without it.

    Args:
        memory_budget: whether the job checkpoints by a memory budget.
        compile_model: ``compile.enable`` with the model among its components.
        setting: how the torchtitan version's config names memory-budget AC, for the message.
        others: how it names the other modes, for the message.

    Raises:
        ValueError: a memory budget without compiled blocks.
    """
    if memory_budget and not compile_model:
        raise ValueError(
            f"{setting} needs torch.compile of the model: set compile.enable = true with 'model' in "
            f"compile.components, or use {others}"
        )


def check_validation(validating: bool, *, setting: str, schedule: str, cp_degree: int) -> None:
    """Refuse torchtitan's validator with a sequence schedule it cannot run.

    The validator runs the schedule forward only (its ``eval``), on whole sequences: under context
    parallelism it shards them (and the RoPE table) for its own CP, where a sequence schedule shards each
    unit itself; BSIPipe's V turns hand each unit's gradient to the next chunk on the same rank, which
    torch's runtime does in ``eval`` too, where there is none.

    Args:
        validating: whether the job validates.
        setting: how the torchtitan version's config turns validation on, for the message.
        schedule: the sequence schedule's name.
        cp_degree: the context-parallel degree.

    Raises:
        ValueError: validation under CP, or with BSIPipe.
    """
    if validating and cp_degree > 1:
        raise ValueError(
            f"parallelism.context_parallel_degree = {cp_degree} with the sequence schedule {schedule} cannot run "
            f"with {setting} yet: torchtitan's validator shards whole sequences (and the RoPE table) for its own "
            "CP; turn validation off (or CP)"
        )
    if validating and schedule == "BSIPipe":
        raise ValueError(
            f"{setting} with the sequence schedule BSIPipe: its V turns hand each unit's gradient to the next chunk "
            "on the same rank, which torch's runtime does when validating too, where there is none; turn validation "
            "off or use another sequence schedule (e.g. Chimera)"
        )


def check_instrumentation(activation_memory_freq: int) -> None:
    """Refuse a negative ``sequence_pipeline.activation_memory_freq``.

    Args:
        activation_memory_freq: meter every N-th logged step (N >= 1), or never (0).

    Raises:
        ValueError: it is negative.
    """
    if activation_memory_freq < 0:
        raise ValueError(
            f"sequence_pipeline.activation_memory_freq = {activation_memory_freq} is negative: use N >= 1 "
            "(every N-th logged step) or 0 (never)"
        )


def check_shape(sequence_pipeline: Any, parallelism: Any, training: Any, model_shape: Any) -> None:
    """Refuse a job shape the sequence schedule cannot run, or a schedule the installed torch cannot.

    The shape is :func:`~torchtitan_seq.titan.pipeline_core.job_shape`'s: the sequence cut (k lengths),
    v chunks per rank, N microbatches and p pipeline ranks.

    Args:
        sequence_pipeline: the job's ``[sequence_pipeline]`` section.
        parallelism: its ``parallelism`` section (a sequence schedule named).
        training: its ``training`` section (sequence length, local batch).
        model_shape: the flavor's shape (its layers and heads).

    Raises:
        ValueError: the sequence cannot be cut as asked, the layers per stage do not fit the schedule,
            the schedule cannot run the shape, or the installed torch cannot run the schedule.
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


def check_kv_context(kv_context: str, model_name: str, model_args: Any, compiled: bool = False) -> None:
    """Refuse a K/V context the model cannot keep: ``"latent"`` keeps multi-head latent attention's latent
    (:mod:`torchtitan_seq.runtime.kv_latent`), which only an MLA model computes.

    Args:
        kv_context: the job's ``sequence_pipeline.kv_context``.
        model_name: its ``model.name``.
        model_args: the flavor's model args (or shape).
        compiled: whether the job compiles the model's blocks.

    Raises:
        ValueError: ``"latent"`` for a model without MLA, or compiled (the latent's autograd functions write
            the context from inside the block, which torch.compile's graphs do not run as written).
    """
    if kv_context == "latent" and compiled:
        raise ValueError(
            "sequence_pipeline.kv_context = 'latent' with compile.enable (model): the latent's prefix expansion "
            "runs outside torch.compile's graphs, not yet inside them; use 'reach', or turn compile off"
        )
    if kv_context == "latent" and model_shape(model_args).mla is None:
        raise ValueError(
            f"sequence_pipeline.kv_context = 'latent' keeps multi-head latent attention's latent, which "
            f"model.name = {model_name!r} does not compute: use 'reach' (or 'full'), or an MLA model (deepseek_v3)"
        )


def check_attention_backend(backend: str) -> None:
    """``sequence_pipeline.attention_backend``: 'flash' is flash-attn 2, a CUDA library and an optional extra
    (:func:`~torchtitan_seq.attention.kernels.select_kernel`)."""
    if backend != "flash":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            "sequence_pipeline.attention_backend = 'flash' needs a CUDA device (flash-attn has no CPU kernel): "
            "use 'auto' or 'sdpa' on the CPU"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "sequence_pipeline.attention_backend = 'flash' but flash-attn is not installed: pip install "
            "flash-attn, or use 'auto' or 'sdpa'"
        )


def check_dataset(setting: str, dataset: str, dataset_path: str | None, paths: dict[str, str], shipped: str) -> None:
    """A dataset the job reads is registered and, offline (``HF_DATASETS_OFFLINE=1``, which
    ``torchtitan_seq.train`` sets unless told otherwise), on this machine: a shipped one, or a
    ``dataset_path`` that exists.

    Args:
        setting: the dataset's setting as the user writes it, e.g. ``training.dataset``; its section's
            ``dataset_path`` is the fix named.
        dataset: its value.
        dataset_path: the section's ``dataset_path`` (None or empty: the registered path).
        paths: torchtitan's registered datasets, name -> the path or Hub name read.
        shipped: the shipped dataset the fix names.
    """
    if dataset not in paths:
        raise ValueError(f"{setting} = {dataset!r} is unknown: use one of {', '.join(paths)}")
    path = dataset_path or paths[dataset]
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" and not os.path.exists(path):
        section = setting.rpartition(".")[0]
        raise ValueError(
            f"{setting} = {dataset!r} is read from the Hugging Face Hub ({path}), but jobs run offline "
            f"(HF_DATASETS_OFFLINE=1): use a shipped dataset (e.g. {setting} = {shipped!r}) or set "
            f"{section}.dataset_path to a local copy, or HF_DATASETS_OFFLINE=0 to stream it"
        )
