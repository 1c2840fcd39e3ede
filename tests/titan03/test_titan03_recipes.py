"""torchtitan 0.3: the shipped config functions, their overrides and the job check."""

from __future__ import annotations

import pytest

from torchtitan_seq.titan_version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="torchtitan 0.3's config functions need torchtitan 0.3")

RECIPES = {
    "llama3_debugmodel_seq1f1b": ("debugmodel", "seqpp_text"),
    "llama3_debugmodel_block_causal_seq1f1b": ("debugmodel_flex_attn", "seqpp_packed"),
    "llama3_8b_32k_seq1f1b": ("8B", "c4"),
    "llama3_8b_32k_block_causal_seq1f1b": ("8B_flex", "c4"),
}


def _parse(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "torchtitan_seq.recipes", *args])


@pytest.mark.parametrize("name", RECIPES)
def test_each_shipped_job_is_a_config_function(name):
    """One per TOML file of train_configs/, chosen with --module/--config as 0.3 chooses its own."""
    from torchtitan_seq.titan03.trainer import SeqTrainer

    config = _parse("--config", name)
    assert isinstance(config, SeqTrainer.Config)
    assert (config.model_spec.flavor, config.dataloader.dataset) == RECIPES[name]
    assert config.parallelism.pipeline_parallel_schedule == "Seq1F1B"
    assert config.model_spec.model.block_causal == name.endswith("block_causal_seq1f1b")


def test_the_sequence_pipeline_section_takes_overrides_as_0_3_takes_its_own():
    config = _parse(
        "--config",
        "llama3_debugmodel_seq1f1b",
        "--parallelism.pipeline-parallel-schedule",
        "BSIPipe",
        "--sequence-pipeline.num-subsequences",
        "8",
        "--sequence-pipeline.partition",
        "even",
    )
    assert config.parallelism.pipeline_parallel_schedule == "BSIPipe"
    assert (config.sequence_pipeline.num_subsequences, config.sequence_pipeline.partition) == (8, "even")


@pytest.mark.parametrize(
    "args,match",
    [
        (["--parallelism.pipeline-parallel-schedule", "Seq2F2B"], "pipeline_parallel_schedule = 'Seq2F2B' is unknown"),
        (["--compile.enable"], "compile.enable = true with the sequence schedule Seq1F1B"),
        (["--parallelism.pipeline-parallel-degree", "4"], "do not fit 2 processes"),
        (["--sequence-pipeline.num-subsequences", "64"], "sequence_pipeline"),
        (["--parallelism.pipeline-parallel-schedule", "BSIPipe", "--training.local-batch-size", "3"], "BSIPipe"),
        (["activation-checkpoint:full"], "activation_checkpoint"),
        (["--sequence-pipeline.pipeline-timeline"], "sequence_pipeline.pipeline_timeline = true"),
        (["--parallelism.spmd-backend", "full_dtensor"], "parallelism.spmd_backend = 'full_dtensor'"),
        (["--sequence-pipeline.activation-memory-freq", "10"], "sequence_pipeline.activation_memory_freq > 0"),
    ],
)
def test_the_job_check_refuses_in_one_line(args, match):
    from torchtitan_seq.titan03.job_check import check_job

    config = _parse("--config", "llama3_debugmodel_seq1f1b", *args)
    with pytest.raises(ValueError, match=match) as e:
        check_job(config, 2)
    assert "\n" not in str(e.value)


def test_fsdp_with_a_sequence_schedule_is_refused_until_tested():
    from torchtitan_seq.titan03.job_check import check_job

    config = _parse("--config", "llama3_debugmodel_seq1f1b", "--parallelism.data-parallel-shard-degree", "2")
    with pytest.raises(ValueError, match="4 processes for parallelism.pipeline_parallel_degree = 2"):
        check_job(config, 4)


def test_the_planners_config_function_builds_the_plan():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from torchtitan_seq.plan import Plan

    plan = Plan("BSIPipe", 2, 1, 1, 2, "even", 4, "selective", 1.0, 1.0, 0.1, True, length_multiple=64)
    scope: dict = {}
    exec(plan.config_function("debugmodel_flex_attn", 1024, 8), scope)
    config = scope["plan"]()
    assert config.model_spec.model.block_causal and config.training.seq_len == 1024
    assert config.parallelism.pipeline_parallel_schedule == "BSIPipe"
    assert (config.sequence_pipeline.num_subsequences, config.sequence_pipeline.partition) == (2, "even")
    assert isinstance(config.activation_checkpoint, SelectiveAC.Config)
