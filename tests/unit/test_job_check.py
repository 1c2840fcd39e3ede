"""The job check refuses, in one message naming the setting, every setting that would pass it
and then crash on the ranks (torchtitan_seq.titan.v022.job_check.check_job, in this process)."""

import pytest
from torchtitan.config import ConfigManager

from torchtitan_seq.titan.v022.job_check import check_job
from torchtitan_seq.titan.v022.registration import register
from torchtitan_seq.train import resolve_args

CONFIG = ("--job.config_file", "train_configs/debug_model.toml")


def _check(*overrides: str, world: int = 2) -> None:
    register()
    check_job(ConfigManager().parse_args(resolve_args([*CONFIG, *overrides])), world)


def test_the_shipped_config_passes():
    _check()
    validation = ("--validation.enable", "--validation.seq_len", "2048", "--validation.local_batch_size", "4")
    _check(*validation, "--validation.dataset", "seqpp_text_validation")  # torchtitan's default, c4, is online


@pytest.mark.parametrize("flavor", ["debugmodel_flex_attn", "debugmodel_varlen_attn"])
@pytest.mark.parametrize("schedule", ["Seq1F1B", "InterleavedSeq1F1B", "BSIPipe", "Chimera", "TeraPipe", "1F1B"])
def test_block_causal_flavors_pass(flavor, schedule):
    _check(
        "--model.flavor",
        flavor,
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--sequence_pipeline.expected_document_length",
        "512",
    )


GPT_OSS_FSDP = ("--parallelism.pipeline_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "2")
"""gpt-oss on the 2 processes of :data:`REFUSALS` under FSDP, which it needs, without a pipeline."""

GPT_OSS_FSDP = ("--parallelism.pipeline_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "2")
"""gpt-oss on the 2 processes of :data:`REFUSALS` under FSDP, which it needs, without a pipeline."""

REFUSALS: list[tuple[tuple[str, ...], str]] = [
    # (overrides of the shipped config, on 2 CPU processes; what the one-line refusal says)
    (("--model.name", "llama3_ft"), "cannot run model.name = 'llama3_ft': it has no chunk-aware attention"),
    (("--sequence_pipeline.kv_context", "latent"), "which model.name = 'llama3_seq' does not compute"),
    (("--compile.enable", "--sequence_pipeline.split_backward"), "split_backward = true cannot run with compile"),
    (("--model.name", "gpt_oss"), "model.name = 'gpt_oss' needs FSDP (parallelism.data_parallel_shard_degree = 1)"),
    (
        ("--activation_checkpoint.mode", "memory_budget"),
        "activation_checkpoint.mode = 'memory_budget' needs torch.compile",
    ),
    (
        ("--activation_checkpoint.mode", "memory_budget", "--parallelism.pipeline_parallel_schedule", "1F1B"),
        "activation_checkpoint.mode = 'memory_budget' needs torch.compile",
    ),
    (("--model.flavor", "debugmodel_flash"), "model.flavor = 'debugmodel_flash' is not a flavor"),
    (("--parallelism.pipeline_parallel_schedule", "Bogus"), "parallelism.pipeline_parallel_schedule = 'Bogus'"),
    (("--sequence_pipeline.num_subsequences", "4096"), "sequence_pipeline.num_subsequences = 4096"),
    (
        ("--model.name", "qwen3", "--model.flavor", "debugmodel"),
        "model.flavor = 'debugmodel' of model.name = 'qwen3' ties its output layer to the embeddings",
    ),
    (
        ("--model.name", "llama4", "--model.flavor", "debugmodel_irope", "--compile.enable"),
        "model.name = 'llama4' with the sequence schedule Seq1F1B cannot run with compile.enable = true yet",
    ),
    (
        ("--model.name", "gpt_oss", "--sequence_pipeline.split_backward", *GPT_OSS_FSDP),
        "model.name = 'gpt_oss' with the sequence schedule Seq1F1B cannot run with sequence_pipeline.split_backward",
    ),
    (
        ("--sequence_pipeline.expected_document_length", "512"),
        "sequence_pipeline.expected_document_length = 512 needs a block-causal flavor",
    ),
    (("--validation.enable", "--validation.seq_len", "1024"), "validation.seq_len = 1024 differs"),
    (
        ("--validation.enable", "--validation.seq_len", "2048", "--validation.local_batch_size", "3"),
        "validation.local_batch_size = 3",
    ),
    (
        ("--validation.enable", "--validation.seq_len", "2048", "--parallelism.pipeline_parallel_schedule", "BSIPipe"),
        "validation.enable = true with the sequence schedule BSIPipe",
    ),
    (("--parallelism.data_parallel_shard_degree", "2"), "do not fit 2 processes"),
    (("--sequence_pipeline.activation_memory_freq", "-1"), "activation_memory_freq = -1 is negative"),
    (
        ("--training.local_batch_size", "3", "--parallelism.pipeline_parallel_microbatch_size", "2"),
        "training.local_batch_size = 3 is not a multiple",
    ),
    (
        (
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--sequence_pipeline.split_backward",
        ),
        "selective_ac_option = 'op'",
    ),
    (("--sequence_pipeline.attention_backend", "flash"), "attention_backend = 'flash' needs a CUDA device"),
    (("--training.dataset", "bogus"), "training.dataset = 'bogus' is unknown"),
    (("--model.converters", "quantize.linear.float8"), "model.converters"),
    (("--parallelism.pipeline_parallel_schedule", "DualPipeV"), "pipeline_parallel_expert_parallel_overlap = false"),
]


@pytest.mark.parametrize("overrides,needle", REFUSALS, ids=[needle[:40] for _, needle in REFUSALS])
def test_refused_in_one_message_naming_the_setting(overrides, needle):
    with pytest.raises(ValueError, match=None) as e:
        _check(*overrides)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_compile_with_tp_passes_where_torch_is_repaired_and_is_refused_where_not(monkeypatch):
    from torchtitan_seq.titan import job_rules

    tp = ("--compile.enable", "--parallelism.tensor_parallel_degree", "2")
    for schedule in ("Seq1F1B", "1F1B"):  # torch's own needs the repair too
        _check(*tp, "--parallelism.pipeline_parallel_schedule", schedule, world=4)
    monkeypatch.setattr(job_rules, "ASYNC_COLLECTIVE_REPAIRABLE", False)
    with pytest.raises(ValueError) as e:
        _check(*tp, world=4)
    assert "compile.enable = true cannot run with parallelism.tensor_parallel_degree = 2 on torch" in str(e.value)
    _check("--compile.enable", "--parallelism.data_parallel_shard_degree", "2", world=4)  # FSDP2 runs


@pytest.mark.parametrize(
    "name,flavor",
    [
        ("deepseek_v3", "debugmodel"),
        ("deepseek_v3", "debugmodel_flex_attn"),
        ("llama4", "debugmodel"),
        ("llama4", "debugmodel_irope"),
        ("gpt_oss", "debugmodel"),
    ],
)
@pytest.mark.parametrize("schedule", ["Seq1F1B", "BSIPipe"])
def test_families_with_flex_flavors_pass(name, flavor, schedule):
    fsdp = ("--parallelism.data_parallel_shard_degree", "2") if name == "gpt_oss" else ()
    _check("--model.name", name, "--model.flavor", flavor, "--parallelism.pipeline_parallel_schedule", schedule,
           *fsdp, world=4 if fsdp else 2)  # fmt: skip


def test_deepseek_v3_with_tp_and_families_with_cp_are_refused():
    deepseek = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
    with pytest.raises(ValueError, match="model.name = 'deepseek_v3' with the sequence schedule Seq1F1B cannot run "
                       "with parallelism.tensor_parallel_degree = 2: under torchtitan 0.2.2's TP plan"):  # fmt: skip
        _check(*deepseek, "--parallelism.tensor_parallel_degree", "2", world=4)
    for name in ("deepseek_v3", "llama4", "gpt_oss"):
        with pytest.raises(ValueError, match=f"model.name = '{name}' .*context_parallel_degree = 2 yet"):
            _check("--model.name", name, "--model.flavor", "debugmodel", "--parallelism.context_parallel_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "2", world=8)  # fmt: skip


def test_compile_with_split_backward_is_refused():
    with pytest.raises(ValueError) as e:
        _check("--compile.enable", "--sequence_pipeline.split_backward")
    assert "split_backward = true cannot run with compile.enable = true" in str(e.value)


@pytest.mark.parametrize("schedule", ["BSIPipe", "Chimera"])
def test_two_chains_refuse_torch_2_11(monkeypatch, schedule):
    """torch 2.11 (the GPU machine's) infers stage shapes in rank order, which two chains break."""
    import torch
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0+cu130"))
    with pytest.raises(ValueError, match=f"'{schedule}' needs torch 2.13 or newer, not 2.11.0"):
        _check("--parallelism.pipeline_parallel_schedule", schedule)
    _check("--parallelism.pipeline_parallel_schedule", "InterleavedSeq1F1B")  # one chain: runs on 2.11


CP2 = ("--parallelism.context_parallel_degree", "2")


@pytest.mark.parametrize("schedule", ["Seq1F1B", "InterleavedSeq1F1B", "BSIPipe", "Chimera", "TeraPipe"])
@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_flex_attn"])
def test_context_parallel_passes_with_every_sequence_schedule(schedule, flavor):
    _check(*CP2, "--parallelism.pipeline_parallel_schedule", schedule, "--model.flavor", flavor, world=4)


def test_context_parallel_passes_with_compile():
    _check(*CP2, "--compile.enable", world=4)


CP_REFUSALS: list[tuple[tuple[str, ...], str]] = [
    # (overrides of the shipped config with CP2, on 4 CPU processes; what the one-line refusal says)
    (("--validation.enable", "--validation.seq_len", "2048"), "cannot run with validation.enable = true yet"),
    (("--parallelism.context_parallel_rotate_method", "alltoall"), "context_parallel_rotate_method = 'allgather'"),
    (("--parallelism.context_parallel_load_balancer", "ptrr"), "context_parallel_load_balancer = 'headtail'"),
    (("--sequence_pipeline.length_multiple", "1", "--training.seq_len", "2050"), "not a multiple of 4"),
    (("--parallelism.pipeline_parallel_schedule", "1F1B"), "torch's ring attention, which has no CPU kernel"),
]


@pytest.mark.parametrize(
    "overrides,needle", CP_REFUSALS, ids=["validation", "alltoall", "ptrr", "seq-len", "torch-schedule-on-cpu"]
)
def test_context_parallel_refusals_name_the_setting(overrides, needle):
    with pytest.raises(ValueError) as e:
        _check(*CP2, *overrides, world=4)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("config", ["llama3_8b_32k", "llama3_8b_32k_block_causal"])
def test_the_8b_configs_take_context_parallelism_as_their_comment_says(config, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # they stream c4 from the Hub, as a cluster can
    register()
    args = ["--job.config_file", f"train_configs/{config}.toml", *CP2, "--parallelism.data_parallel_shard_degree", "1"]
    args += ["--training.seq_len", "131072", "--compile.no-enable"]
    check_job(ConfigManager().parse_args(resolve_args(args)), 8)


def test_torch_schedules_refuse_cp_on_block_causal_flavors(monkeypatch):
    """On CUDA torchtitan's own CP runs, but not on llama3_seq's document ids."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    overrides = ("--parallelism.pipeline_parallel_schedule", "1F1B", "--model.flavor", "debugmodel_flex_attn")
    with pytest.raises(ValueError, match="torchtitan's CP shards flex attention's block masks"):
        _check(*CP2, *overrides, "--parallelism.data_parallel_shard_degree", "2", world=8)


def test_latent_kv_context_needs_mla():
    """kv_context = 'latent' keeps MLA's latent: DeepSeek-V3 passes, a model without MLA is refused in one line."""
    latent = ("--sequence_pipeline.kv_context", "latent")
    _check("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *latent)
    with pytest.raises(ValueError, match="sequence_pipeline.kv_context = 'latent' .* model.name = 'llama3_seq'"):
        _check(*latent)
