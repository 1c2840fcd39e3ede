"""torchtitan 0.3: the shipped config functions, their overrides and the job check."""

from __future__ import annotations

import pytest

from titan03_run import parse_job
from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="torchtitan 0.3's config functions need torchtitan 0.3")

RECIPES = {
    "llama3_debugmodel_seq1f1b": ("debugmodel", "seqpp_text"),
    "llama3_debugmodel_block_causal_seq1f1b": ("debugmodel_flex_attn", "seqpp_packed"),
    "llama3_8b_32k_seq1f1b": ("8B", "c4"),
    "llama3_8b_32k_block_causal_seq1f1b": ("8B_flex", "c4"),
}


@pytest.mark.parametrize("name", RECIPES)
def test_each_shipped_job_is_a_config_function(name):
    """One per TOML file of train_configs/, chosen with --module/--config as 0.3 chooses its own."""
    from torchtitan_seq.titan.v03.trainer import SeqTrainer

    config = parse_job("--config", name)
    assert isinstance(config, SeqTrainer.Config)
    assert (config.model_spec.flavor, config.dataloader.dataset) == RECIPES[name]
    assert config.parallelism.pipeline_parallel_schedule == "Seq1F1B"
    assert config.model_spec.model.block_causal == name.endswith("block_causal_seq1f1b")


def test_the_sequence_pipeline_section_takes_overrides_as_0_3_takes_its_own():
    config = parse_job(
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
        # torchtitan's validator shards whole sequences for its own CP
        (
            ["--validator.enable", "--parallelism.context-parallel-degree", "2"],
            4,
            "cannot run with validator.enable = true yet",
        ),
        # BSIPipe's V turns hand gradients over on the rank, which torch's runtime does in eval too
        (
            ["--validator.enable", "--parallelism.pipeline-parallel-schedule", "BSIPipe"],
            2,
            "validator.enable = true with the sequence schedule BSIPipe",
        ),
    ],
)
def test_the_job_check_refuses_in_one_line(args, world, match):
    from torchtitan_seq.titan.v03.job_check import check_job

    config = parse_job("--config", "llama3_debugmodel_seq1f1b", *args)
    with pytest.raises(ValueError, match=match) as e:
        check_job(config, world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args,world",
    [
        (["--parallelism.data-parallel-shard-degree", "2", "activation-checkpoint:selective"], 4),
        (["--parallelism.tensor-parallel-degree", "2", "activation-checkpoint:full"], 4),
        (["--compile.enable"], 2),
        (["--parallelism.context-parallel-degree", "2"], 4),
        (["--parallelism.data-parallel-replicate-degree", "2", "--validator.enable"], 4),
        (["--parallelism.tensor-parallel-degree", "2", "--validator.enable"], 4),
        # what tests/titan03/test_titan03_harness.py checks exact
        (["--parallelism.data-parallel-replicate-degree", "2", "--parallelism.data-parallel-shard-degree", "2"], 8),
        (["--compile.enable", "activation-checkpoint:memory-budget"], 2),
    ],
)
def test_the_job_check_passes_what_tests_titan03_compose_runs(args, world):
    from torchtitan_seq.titan.v03.job_check import check_job

    check_job(parse_job("--config", "llama3_debugmodel_seq1f1b", *args), world)


def test_the_job_check_refuses_memory_budget_ac_without_compile_in_one_line():
    """0.3's own config refuses it when parsed; a config changed after that meets the job check."""
    from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC

    from torchtitan_seq.titan.v03.job_check import check_job

    config = parse_job("--config", "llama3_debugmodel_seq1f1b")
    config.activation_checkpoint = MemoryBudgetAC.Config()
    with pytest.raises(ValueError, match="activation-checkpoint:memory-budget needs torch.compile") as e:
        check_job(config, 2)
    assert "\n" not in str(e.value)


def test_the_job_check_refuses_0_3s_own_validator_in_one_line():
    """0.3's validator would hand a sequence schedule per-document positions and no document ids."""
    from torchtitan.components.validate import Validator

    from torchtitan_seq.titan.v03.job_check import check_job
    from torchtitan_seq.titan.v03.validate import SeqValidator

    config = parse_job("--config", "llama3_debugmodel_block_causal_seq1f1b", "--validator.enable")
    assert isinstance(config.validator, SeqValidator.Config)
    assert config.validator.dataloader.dataset == "seqpp_text_validation"  # shipped: nothing from the Hub
    config.validator = Validator.Config(enable=True)
    with pytest.raises(ValueError, match="use torchtitan_seq's SeqValidator.Config") as e:
        check_job(config, 2)
    assert "\n" not in str(e.value)


CP2 = ("--parallelism.context-parallel-degree", "2")


@pytest.mark.parametrize("schedule", ["Seq1F1B", "InterleavedSeq1F1B", "BSIPipe", "Chimera", "TeraPipe"])
@pytest.mark.parametrize(
    "config", ["llama3_debugmodel_seq1f1b", "llama3_debugmodel_block_causal_seq1f1b", "qwen3_debugmodel_untied_seq1f1b"]
)
def test_context_parallel_passes_with_every_sequence_schedule(config, schedule):
    """What tests/titan03/test_titan03_harness.py checks exact: pp 2 x cp 2, dense families, packed documents."""
    from torchtitan_seq.titan.v03.job_check import check_job

    check_job(parse_job("--config", config, *CP2, "--parallelism.pipeline-parallel-schedule", schedule), 4)


@pytest.mark.parametrize(
    "config,args,world,match",
    [
        (
            "llama3_debugmodel_seq1f1b",
            ["--parallelism.pipeline-parallel-schedule", "1F1B"],
            4,
            "torch's schedule '1F1B'",
        ),
        ("llama3_debugmodel_seq1f1b", ["--parallelism.pipeline-parallel-degree", "1"], 2, "and no pipeline: 0.3 would"),
        (
            "llama3_debugmodel_seq1f1b",
            ["--parallelism.context-parallel-load-balancer", "ptrr"],
            4,
            "context_parallel_load_balancer = 'ptrr' with the sequence schedule Seq1F1B",
        ),
        ("qwen3_debugmodel_moe_seq1f1b", [], 4, "context_parallel_degree = 2 with qwen3_seq and the sequence"),
        ("deepseek_v3_debugmodel_seq1f1b", [], 4, "MoE layers under CP are not checked exact"),
        ("gpt_oss_debugmodel_seq1f1b", [], 4, "MoE layers under CP are not checked exact"),
    ],
    ids=["torch-schedule", "no-pipeline", "ptrr", "qwen3-moe", "deepseek-v3", "gpt-oss"],
)
def test_the_job_check_refuses_context_parallelism_it_does_not_run_in_one_line(config, args, world, match):
    from torchtitan_seq.titan.v03.job_check import check_job

    with pytest.raises(ValueError, match=match) as e:
        check_job(parse_job("--config", config, *CP2, *args), world)
    assert "\n" not in str(e.value)


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

    config = parse_job("--config", name)
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
    config = parse_job("--config", "llama3_debugmodel_seq1f1b", *args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    fails = device == "cuda" and schedule == "Seq1F1B" and pp > 1 and param_dtype not in ("bfloat16", "float16")
    if not fails:
        check_job(config, pp * shard)
        return
    with pytest.raises(ValueError, match="mixed_precision_param") as e:
        check_job(config, pp * shard)
    assert "\n" not in str(e.value)
