"""torchtitan 0.3: nothing that passes the job check crashes later. Every setting a user can give, one
non-default value at a time (and the pairs the job check names), is refused in one line by the check (or
by torchtitan when it builds the config) or trains a step on 2 ranks (tests/helpers/settings_walk.py).

The walk covers, in 0.3's spelling, every field of the ``sequence_pipeline`` section, every schedule name
(torch's and this project's) and the settings the v03 job check reasons about: parallel degrees,
activation checkpointing (0.3's ``activation-checkpoint:<mode>`` subcommands), compile, the validator,
mixed precision, the other families' config functions, the loss, the SPMD backend, expert parallelism,
CPU offload and schedule CSVs. On a CPU, CUDA-only values (flash-attn) must be refused by the check.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from settings_walk import assert_refused_in_one_line, assert_the_walk_holds, check, forbidden
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES
from torchtitan_seq.titan.config import SequencePipeline
from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="the settings walk of torchtitan 0.3's command line")

PP1 = ("--parallelism.pipeline-parallel-degree", "1")
BLOCK_CAUSAL = ("--config", "llama3_debugmodel_block_causal_seq1f1b")
QWEN3_MOE = ("--config", "qwen3_debugmodel_moe_seq1f1b")
GPT_OSS = ("--config", "gpt_oss_debugmodel_seq1f1b")
COMPILE = ("--compile.enable", "--compile.components", "model")
VALIDATOR = ("--validator.enable", "--validator.steps", "1")

# name -> overrides on llama3_debugmodel_seq1f1b (Seq1F1B, pp 2, k 4, 256 tokens: settings_walk.BASE)
SEQUENCE_PIPELINE = {
    "num_subsequences=1": ("--sequence-pipeline.num-subsequences", "1"),
    "num_subsequences=2": ("--sequence-pipeline.num-subsequences", "2"),
    "num_subsequences=8": ("--sequence-pipeline.num-subsequences", "8"),
    "partition=even": ("--sequence-pipeline.partition", "even"),
    "partition=latency": ("--sequence-pipeline.partition", "latency"),
    "expected_document_length=64+block_causal": (*BLOCK_CAUSAL, "--sequence-pipeline.expected-document-length", "64"),
    "length_multiple=1": ("--sequence-pipeline.length-multiple", "1"),
    "length_multiple=0": ("--sequence-pipeline.length-multiple", "0"),
    "length_multiple=128": ("--sequence-pipeline.length-multiple", "128"),
    "split_backward": ("--sequence-pipeline.split-backward",),
    "attention_backend=flash": ("--sequence-pipeline.attention-backend", "flash"),
    "kv_context=full+gpt_oss": (*GPT_OSS, "--sequence-pipeline.kv-context", "full"),  # sliding windows
    "kv_context=latent": ("--sequence-pipeline.kv-context", "latent"),  # Llama 3 has no MLA
    "kv_context=latent+deepseek_v3+compile": (  # refused: the latent's expansion is not compiled yet
        "--config",
        "deepseek_v3_debugmodel_seq1f1b",
        "--sequence-pipeline.kv-context",
        "latent",
        *COMPILE,
    ),
    "kv_context=latent+deepseek_v3": (
        "--config",
        "deepseek_v3_debugmodel_seq1f1b",
        "--sequence-pipeline.kv-context",
        "latent",
    ),
    "kv_offload": ("--sequence-pipeline.kv-offload",),
    "kv_offload+InterleavedSeq1F1B": (  # arenas go to host memory between a chunk's units
        "--sequence-pipeline.kv-offload",
        "--parallelism.pipeline-parallel-schedule",
        "InterleavedSeq1F1B",
    ),
    "bidirectional_placement=linear+Chimera": (
        "--sequence-pipeline.bidirectional-placement",
        "linear",
        "--parallelism.pipeline-parallel-schedule",
        "Chimera",
    ),
    "activation_memory_freq=0": ("--sequence-pipeline.activation-memory-freq", "0"),
    "activation_memory_freq=-1": ("--sequence-pipeline.activation-memory-freq", "-1"),
    "pipeline_timeline=false": ("--sequence-pipeline.no-pipeline-timeline",),
}
SCHEDULES = {
    f"schedule={name}": ("--parallelism.pipeline-parallel-schedule", name)
    for name in (*SEQUENCE_SCHEDULES, *TORCH_SCHEDULES)
}
TORCHTITAN = {
    # parallel degrees: alone they do not fit 2 processes with pp 2; with pp 1 they do
    "tensor_parallel_degree=2": ("--parallelism.tensor-parallel-degree", "2"),
    "context_parallel_degree=2": ("--parallelism.context-parallel-degree", "2"),
    "data_parallel_shard_degree=2": ("--parallelism.data-parallel-shard-degree", "2"),
    "data_parallel_replicate_degree=2": ("--parallelism.data-parallel-replicate-degree", "2"),
    "expert_parallel_degree=2": ("--parallelism.expert-parallel-degree", "2"),
    "pipeline_parallel_degree=1": PP1,
    "pp1+tp2": (*PP1, "--parallelism.tensor-parallel-degree", "2"),
    "pp1+cp2": (*PP1, "--parallelism.context-parallel-degree", "2"),
    "pp1+dp_shard2": (*PP1, "--parallelism.data-parallel-shard-degree", "2"),
    "pp1+dp_replicate2": (*PP1, "--parallelism.data-parallel-replicate-degree", "2"),
    "pp1+dp_shard2+float32": (
        *PP1,
        "--parallelism.data-parallel-shard-degree",
        "2",
        "--training.mixed-precision-param",
        "float32",
    ),
    "qwen3_moe+pp1+dp_shard2+ep2": (
        *QWEN3_MOE,
        *PP1,
        "--parallelism.data-parallel-shard-degree",
        "2",
        "--parallelism.expert-parallel-degree",
        "2",
    ),
    "mixed_precision_param=float32": ("--training.mixed-precision-param", "float32"),
    "dtype=bfloat16": ("--training.dtype", "bfloat16"),
    "microbatch_size=2": ("--parallelism.pipeline-parallel-microbatch-size", "2"),
    "microbatch_size=3": ("--parallelism.pipeline-parallel-microbatch-size", "3"),
    # 0.3 picks activation checkpointing with a subcommand (torchtitan.distributed.activation_checkpoint)
    "ac=full": ("activation-checkpoint:full",),
    "ac=selective": ("activation-checkpoint:selective",),
    "ac=selective+split_backward": ("--sequence-pipeline.split-backward", "activation-checkpoint:selective"),
    "ac=memory-budget": ("activation-checkpoint:memory-budget",),
    "validator": VALIDATOR,  # SeqValidator's set: the shipped one
    "validator+c4": (*VALIDATOR, "--validator.dataloader.dataset", "c4_validation"),  # on the Hub
    "dataset=c4": ("--dataloader.dataset", "c4"),  # on the Hub
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": ("--config", "deepseek_v3_debugmodel_seq1f1b"),
    "gpt_oss": GPT_OSS,
    "gpt_oss+pp1+tp2": (*GPT_OSS, *PP1, "--parallelism.tensor-parallel-degree", "2"),
    "loss=chunked": ("--module", "titan03_user_jobs", "--config", "llama3_debugmodel_chunked_loss"),
    "module=llama3+Seq1F1B": (  # 0.3's own job: its model has no chunk-aware attention, nor the section
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--training.disable-cuda-graphs",
        "--parallelism.pipeline-parallel-degree",
        "2",
        "--parallelism.pipeline-parallel-schedule",
        "Seq1F1B",
    ),
    "spmd_backend=partial_dtensor": ("--parallelism.spmd-backend", "partial_dtensor"),
    "spmd_backend=full_dtensor": ("--parallelism.spmd-backend", "full_dtensor"),
    "enable_cpu_offload": ("--training.enable-cpu-offload",),
    "schedule_csv": ("--parallelism.pipeline-parallel-schedule-csv", "schedule.csv"),
    "compile+split_backward": (*COMPILE, "--sequence-pipeline.split-backward"),
    # last, the slowest: compiled blocks
    "compile": COMPILE,
    "ac=memory-budget+compile": (*COMPILE, "activation-checkpoint:memory-budget"),
}
CASES = {**SEQUENCE_PIPELINE, **SCHEDULES, **TORCHTITAN}

# 4 ranks: checked only (refused in one line, or passed), since the walk trains on 2 ranks and the
# composition tests (test_titan03_compose.py and its neighbours) train what passes.
PP2 = ("--parallelism.pipeline-parallel-degree", "2")
FOUR_RANKS = {
    "pp2+tp2": (*PP2, "--parallelism.tensor-parallel-degree", "2"),
    "pp2+cp2": (*PP2, "--parallelism.context-parallel-degree", "2"),
    "pp2+dp_shard2": (*PP2, "--parallelism.data-parallel-shard-degree", "2"),
    "pp2+dp_replicate2": (*PP2, "--parallelism.data-parallel-replicate-degree", "2"),
    "pp2+tp2+compile": (*PP2, "--parallelism.tensor-parallel-degree", "2", *COMPILE),
    "pp2+cp2+compile": (*PP2, "--parallelism.context-parallel-degree", "2", *COMPILE),
    "pp2+cp2+validator": (*PP2, "--parallelism.context-parallel-degree", "2", *VALIDATOR),
    "pp2+cp2+qwen3_moe": (*QWEN3_MOE, *PP2, "--parallelism.context-parallel-degree", "2"),
    "pp2+tp2+gpt_oss": (*GPT_OSS, *PP2, "--parallelism.tensor-parallel-degree", "2"),
    "pp2+dp_shard2+qwen3_moe+ep2": (
        *QWEN3_MOE,
        *PP2,
        "--parallelism.data-parallel-shard-degree",
        "2",
        "--parallelism.expert-parallel-degree",
        "2",
    ),
    "pp2+dp_shard2+cpu_offload": (
        *PP2,
        "--parallelism.data-parallel-shard-degree",
        "2",
        "--training.enable-cpu-offload",
    ),
}


def test_the_walk_covers_every_setting_and_schedule():
    """A new ``sequence_pipeline`` field or schedule joins the walk (quick: no training)."""
    given = {arg for overrides in CASES.values() for arg in overrides}
    for f in dataclasses.fields(SequencePipeline):
        flag = f.name.replace("_", "-")
        assert f"--sequence-pipeline.{flag}" in given or f"--sequence-pipeline.no-{flag}" in given, f.name
    assert {f"schedule={name}" for name in (*SEQUENCE_SCHEDULES, *TORCH_SCHEDULES)} <= set(CASES)


def test_every_case_parses_and_the_check_decides_it(tmp_path):
    """Quick: each case's command line is 0.3's (one tyro cannot parse would be refused and prove nothing;
    torchtitan may refuse its values when it builds the config), and the check decides each case without
    raising anything but its ``ValueError``."""
    results = check(CASES, tmp_path)
    misspelt = {
        name: r["message"]
        for name, r in results.items()
        if r["outcome"] == "refused"
        and r["message"].startswith("torchtitan refuses the config")
        and "Error parsing Config:" not in r["message"]
    }
    assert not misspelt, json.dumps(misspelt, indent=1)
    crashed = {name: r["message"] for name, r in results.items() if r["outcome"] == "crashed"}
    assert not crashed, json.dumps(crashed, indent=1)


def test_what_needs_4_ranks_is_refused_in_one_line_or_passes_the_check(tmp_path):
    """Quick: the check alone, for 4 processes (what passes, the composition tests train)."""
    results = check(FOUR_RANKS, tmp_path, world=4)
    print("\n".join(f"{name}: {r['outcome']} {r.get('message', '')}" for name, r in results.items()))
    assert not forbidden(results), json.dumps(forbidden(results), indent=1)


REFUSED = {
    "attention_backend=flash": "sequence_pipeline.attention_backend = 'flash' needs a CUDA device",
    "microbatch_size=3": "must be evenly divisible by parallelism.pipeline_parallel_microbatch_size (3)",
    "module=llama3+Seq1F1B": "which has no sequence_pipeline section",
    "dataset=c4": "dataloader.dataset = 'c4'",
    "validator+c4": "validator.dataloader.dataset = 'c4_validation'",
    "kv_context=latent+deepseek_v3+compile": "sequence_pipeline.kv_context = 'latent' with compile.enable (model)",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_would_crash_on_the_ranks_is_refused(name, tmp_path):
    """Quick: the check alone, in this process (the walk trains the rest)."""
    assert_refused_in_one_line(CASES, name, REFUSED[name], tmp_path)


@pytest.mark.slow
def test_every_setting_is_refused_in_one_line_or_trains_a_step(tmp_path):
    assert_the_walk_holds(CASES, tmp_path)
