"""Nothing that passes the job check crashes later: every setting a user can give, one non-default value
at a time (and the pairs the job check names), is refused in one line by the check or trains a step.

The walk covers every field of ``[sequence_pipeline]``, every schedule name (torch's and this
project's) and the torchtitan settings the job check reasons about: parallel degrees, compile,
activation checkpointing modes, validation, float8, attention flavors, mixed precision. On a CPU,
CUDA-only values (flash-attn, float8, DualPipeV's overlap callback) must be refused by the check,
not by a rank. All cases run in one torchrun job of 2 ranks (tests/helpers/settings_walk.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from settings_walk import assert_refused_in_one_line, assert_the_walk_holds
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES
from torchtitan_seq.titan.config import SequencePipeline

VAL = ("--validation.enable", "--validation.seq_len", "256", "--validation.steps", "1")
SHIPPED_VAL = (*VAL, "--validation.dataset", "seqpp_text_validation")
PP1 = ("--parallelism.pipeline_parallel_degree", "1")

# name -> overrides on the debug model's config (Seq1F1B, pp 2, k 4, 256 tokens: settings_walk.BASE).
SEQUENCE_PIPELINE = {
    "num_subsequences=1": ("--sequence_pipeline.num_subsequences", "1"),
    "num_subsequences=2": ("--sequence_pipeline.num_subsequences", "2"),
    "num_subsequences=8": ("--sequence_pipeline.num_subsequences", "8"),
    "partition=even": ("--sequence_pipeline.partition", "even"),
    "partition=latency": ("--sequence_pipeline.partition", "latency"),
    "expected_document_length=64": ("--sequence_pipeline.expected_document_length", "64"),
    "expected_document_length=64+flex": (
        "--sequence_pipeline.expected_document_length",
        "64",
        "--model.flavor",
        "debugmodel_flex_attn",
    ),
    "length_multiple=1": ("--sequence_pipeline.length_multiple", "1"),
    "length_multiple=0": ("--sequence_pipeline.length_multiple", "0"),
    "length_multiple=128": ("--sequence_pipeline.length_multiple", "128"),
    "split_backward": ("--sequence_pipeline.split_backward",),
    "attention_backend=flash": ("--sequence_pipeline.attention_backend", "flash"),
    "attention_backend=sdpa": ("--sequence_pipeline.attention_backend", "sdpa"),
    "kv_context=full": ("--sequence_pipeline.kv_context", "full"),
    "kv_context=reach+llama4": (
        "--sequence_pipeline.kv_context",
        "reach",
        "--model.name",
        "llama4",
        "--model.flavor",
        "debugmodel_irope",
    ),
    "kv_offload": ("--sequence_pipeline.kv_offload",),
    "kv_offload+InterleavedSeq1F1B": (  # arenas go to host memory between a chunk's units
        "--sequence_pipeline.kv_offload",
        "--parallelism.pipeline_parallel_schedule",
        "InterleavedSeq1F1B",
    ),
    "bidirectional_placement=linear": ("--sequence_pipeline.bidirectional_placement", "linear"),
    "bidirectional_placement=linear+Chimera": (
        "--sequence_pipeline.bidirectional_placement",
        "linear",
        "--parallelism.pipeline_parallel_schedule",
        "Chimera",
    ),
    "activation_memory_freq=0": ("--sequence_pipeline.activation_memory_freq", "0"),
    "activation_memory_freq=1": ("--sequence_pipeline.activation_memory_freq", "1"),
    "activation_memory_freq=-1": ("--sequence_pipeline.activation_memory_freq", "-1"),
    "pipeline_timeline=false": ("--sequence_pipeline.no-pipeline-timeline",),
}
SCHEDULES = {
    f"schedule={name}": ("--parallelism.pipeline_parallel_schedule", name)
    for name in (*SEQUENCE_SCHEDULES, *TORCH_SCHEDULES)
}
SCHEDULES["schedule=DualPipeV+no-overlap"] = (
    *SCHEDULES["schedule=DualPipeV"],
    "--parallelism.no-pipeline_parallel_expert_parallel_overlap",
)
TORCHTITAN = {
    # parallel degrees: alone they do not fit 2 processes; with pp 1 they do
    "tensor_parallel_degree=2": ("--parallelism.tensor_parallel_degree", "2"),
    "context_parallel_degree=2": ("--parallelism.context_parallel_degree", "2"),
    "data_parallel_shard_degree=2": ("--parallelism.data_parallel_shard_degree", "2"),
    "data_parallel_replicate_degree=2": ("--parallelism.data_parallel_replicate_degree", "2"),
    "pipeline_parallel_degree=1": PP1,
    "pp1+tp2": (*PP1, "--parallelism.tensor_parallel_degree", "2"),
    "pp1+cp2": (*PP1, "--parallelism.context_parallel_degree", "2"),
    "pp1+dp_shard2": (*PP1, "--parallelism.data_parallel_shard_degree", "2"),
    "pp1+dp_shard2+float32": (
        *PP1,
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.mixed_precision_param",
        "float32",
    ),
    "mixed_precision_param=float32": ("--training.mixed_precision_param", "float32"),
    "microbatch_size=3": ("--parallelism.pipeline_parallel_microbatch_size", "3"),
    "ac=full": ("--activation_checkpoint.mode", "full"),
    "ac=selective-layer": ("--activation_checkpoint.mode", "selective"),
    "ac=selective-op": (
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ),
    "ac=selective-op+split_backward": (
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--sequence_pipeline.split_backward",
    ),
    "ac=memory_budget": ("--activation_checkpoint.mode", "memory_budget"),
    "validation": ("--validation.enable",),
    "validation+seq_len": VAL,  # torchtitan's default validation set, c4, is on the Hub
    "validation+seq_len+shipped": SHIPPED_VAL,
    "validation+seq_len+shipped+batch3": (*SHIPPED_VAL, "--validation.local_batch_size", "3"),
    "dataset=c4": ("--training.dataset", "c4"),
    "float8": ("--model.converters", "quantize.linear.float8"),
    "float8+emulate": ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"),
    "mx": ("--model.converters", "quantize.linear.mx"),
    "flavor=debugmodel_flex_attn": ("--model.flavor", "debugmodel_flex_attn"),
    "flavor=debugmodel_varlen_attn": ("--model.flavor", "debugmodel_varlen_attn"),
    "compile+split_backward": ("--compile.enable", "--sequence_pipeline.split_backward"),
    "compile+memory_budget+1F1B": (
        "--compile.enable",
        "--activation_checkpoint.mode",
        "memory_budget",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
    ),
    # last: torch.compile leaves dynamo's caches behind in the walk's processes
    "compile": ("--compile.enable",),
}
CASES = {**SEQUENCE_PIPELINE, **SCHEDULES, **TORCHTITAN}


def test_the_walk_covers_every_setting_and_schedule():
    """A new ``[sequence_pipeline]`` field or schedule joins the walk (quick: no training)."""
    given = {arg for overrides in CASES.values() for arg in overrides}
    for f in dataclasses.fields(SequencePipeline):
        flag = f"--sequence_pipeline.{f.name}"
        assert flag in given or f"--sequence_pipeline.no-{f.name.replace('_', '-')}" in given, f.name
    assert {f"schedule={name}" for name in (*SEQUENCE_SCHEDULES, *TORCH_SCHEDULES)} <= set(CASES)


REFUSED = {
    # values that passed the check and crashed on every rank before #38
    "attention_backend=flash": "sequence_pipeline.attention_backend = 'flash' needs a CUDA device",
    "schedule=DualPipeV": "needs parallelism.pipeline_parallel_expert_parallel_overlap = false",
    # torchao absent: "need torchao"; present: float8 and MX need a GPU on a CPU-only machine
    "float8": "model.converters = ['quantize.linear.float8']",
    "mx": "model.converters = ['quantize.linear.mx']",
    "pp1+cp2": "with parallelism.pipeline_parallel_degree = 1 (no pipeline: torchtitan's own CP) needs CUDA",
    "validation+seq_len": "validation.dataset = 'c4_validation' is read from the Hugging Face Hub",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_would_crash_on_the_ranks_is_refused_by_the_check(name, tmp_path):
    """Quick: the check alone, in this process (the walk trains the rest)."""
    assert_refused_in_one_line(CASES, name, REFUSED[name], tmp_path)


@pytest.mark.slow
def test_every_setting_is_refused_in_one_line_or_trains_a_step(tmp_path):
    assert_the_walk_holds(CASES, tmp_path)
