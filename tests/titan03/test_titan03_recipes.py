"""torchtitan 0.3: the shipped config functions, their overrides and the job check."""

from __future__ import annotations

import pytest

from torchtitan_seq.titan.version import TITAN_03

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
    from torchtitan_seq.titan.v03.trainer import SeqTrainer

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
    "args,world,match",
    [
        (
            ["--parallelism.pipeline-parallel-schedule", "Seq2F2B"],
            2,
            "pipeline_parallel_schedule = 'Seq2F2B' is unknown",
        ),
        (["--parallelism.pipeline-parallel-degree", "4"], 2, "do not fit 2 processes"),
        (["--sequence-pipeline.num-subsequences", "64"], 2, "sequence_pipeline"),
        (["--parallelism.pipeline-parallel-schedule", "BSIPipe", "--training.local-batch-size", "3"], 2, "BSIPipe"),
        (["--parallelism.spmd-backend", "full_dtensor"], 2, "parallelism.spmd_backend = 'full_dtensor'"),
        (["--sequence-pipeline.activation-memory-freq", "-1"], 2, "activation_memory_freq = -1 is negative"),
        # 0.2.2's rules (torchtitan_seq.titan.job_rules)
        (
            ["--compile.enable", "--sequence-pipeline.split-backward"],
            2,
            "split_backward = true cannot run with compile",
        ),
        (
            ["--sequence-pipeline.split-backward", "activation-checkpoint:selective"],
            2,
            "split_backward = true cannot run with activation-checkpoint:selective",
        ),
        # not tested under 0.3 yet
        (
            ["--parallelism.context-parallel-degree", "2"],
            4,
            "parallelism.context_parallel_degree = 2 with the sequence",
        ),
        (["--parallelism.data-parallel-replicate-degree", "2"], 4, "parallelism.data_parallel_replicate_degree = 2"),
        (
            ["--compile.enable", "activation-checkpoint:memory-budget"],
            2,
            "activation-checkpoint:memory-budget with the sequence schedule",
        ),
    ],
)
def test_the_job_check_refuses_in_one_line(args, world, match):
    from torchtitan_seq.titan.v03.job_check import check_job

    config = _parse("--config", "llama3_debugmodel_seq1f1b", *args)
    with pytest.raises(ValueError, match=match) as e:
        check_job(config, world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args,world",
    [
        (["--parallelism.data-parallel-shard-degree", "2", "activation-checkpoint:selective"], 4),
        (["--parallelism.tensor-parallel-degree", "2", "activation-checkpoint:full"], 4),
        (["--compile.enable"], 2),
    ],
)
def test_the_job_check_passes_what_tests_titan03_compose_runs(args, world):
    from torchtitan_seq.titan.v03.job_check import check_job

    check_job(_parse("--config", "llama3_debugmodel_seq1f1b", *args), world)


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


@pytest.mark.parametrize("name", ["llama3_8b_32k_seq1f1b", "llama3_8b_32k_block_causal_seq1f1b"])
def test_the_8b_jobs_pass_the_check_on_8_processes_and_build_an_8b_model(name):
    """What a CPU can run of the 8B jobs: the job check for their 8 processes (pipeline 4 x FSDP 2,
    compiled blocks) and the model, built on the meta device: Llama 3 8B's 8.03e9 parameters."""
    import torch

    from torchtitan_seq.titan.v03.job_check import check_job

    config = _parse("--config", name)
    check_job(config, 8)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("schedule", ["Seq1F1B", "1F1B"])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("shard", [1, 2])
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_the_job_check_decides_cuda_precision_as_0_3_casts(monkeypatch, device, schedule, pp, shard, param_dtype):
    """0.3's llama3 ``parallelize_fn`` always applies FSDP, which casts the parameters to
    ``training.mixed_precision_param`` even unsharded, so a pipeline trains in that dtype; on CUDA a
    sequence schedule's units (pp > 1) attend with kernels that take bf16 and fp16 only. A refused job
    names the dtype setting in one line."""
    import torch

    from torchtitan_seq.titan.v03.job_check import check_job

    args = ["--parallelism.pipeline-parallel-schedule", schedule, "--parallelism.pipeline-parallel-degree", str(pp)]
    args += ["--parallelism.data-parallel-shard-degree", str(shard), "--training.mixed-precision-param", param_dtype]
    config = _parse("--config", "llama3_debugmodel_seq1f1b", *args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    fails = device == "cuda" and schedule == "Seq1F1B" and pp > 1 and param_dtype not in ("bfloat16", "float16")
    if not fails:
        check_job(config, pp * shard)
        return
    with pytest.raises(ValueError, match="mixed_precision_param") as e:
        check_job(config, pp * shard)
    assert "\n" not in str(e.value)
