"""torchtitan 0.3 config functions: every shipped job, chosen by name as 0.3 chooses its own.

``python -m torchtitan_seq.train --module torchtitan_seq.recipes --config llama3_debugmodel_seq1f1b``
(what ``TORCHTITAN=0.3 ./run_train.sh`` runs), then 0.3's overrides, e.g.
``--parallelism.pipeline-parallel-schedule BSIPipe --sequence-pipeline.num-subsequences 8``. One
function per TOML file of ``train_configs/`` (torchtitan 0.2.2), with the same settings: the Llama 3
debug model and 8B at 32K tokens, causal and block-causal (packed documents). Each returns
:class:`~torchtitan_seq.titan.v03.trainer.SeqTrainer`'s config; its ``sequence_pipeline`` section is
0.2.2's ``[sequence_pipeline]``. Beside them, the debug models of Qwen3 (MoE, and dense with its output
layer untied), DeepSeek-V3 and gpt-oss, which 0.2.2's TOML files do not ship. Needs torchtitan 0.3
(importing this module imports it).
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from torchtitan_seq.assets import TOKENIZER_DIR
from torchtitan_seq.titan.config import SequencePipeline
from torchtitan_seq.titan.data import DATASET_NAME, PACKED_DATASET_NAME
from torchtitan_seq.titan.v03.metrics import SeqMetricsProcessor
from torchtitan_seq.titan.v03.model import sequence_model_spec
from torchtitan_seq.titan.v03.pipeline import pipeline_sequence_llm
from torchtitan_seq.titan.v03.trainer import SeqTrainer

__all__ = [
    "llama3_debugmodel_seq1f1b",
    "llama3_debugmodel_block_causal_seq1f1b",
    "llama3_8b_32k_seq1f1b",
    "llama3_8b_32k_block_causal_seq1f1b",
    "qwen3_debugmodel_moe_seq1f1b",
    "qwen3_debugmodel_untied_seq1f1b",
    "deepseek_v3_debugmodel_seq1f1b",
    "gpt_oss_debugmodel_seq1f1b",
]

# The packed corpus: about 610 tokens a document, BOS and EOS included.
_PACKED_DOCUMENT_LENGTH = 600


def llama3_debugmodel_seq1f1b() -> SeqTrainer.Config:
    """Llama 3 debug model, Seq1F1B (k = 4) on 2 pipeline ranks (CPU by default).

    ``train_configs/debug_model.toml``'s settings: 20 steps of 4 sequences of 2048 tokens from the
    shipped corpus.
    """
    return _debugmodel("llama3", "debugmodel", DATASET_NAME, SequencePipeline(num_subsequences=4, length_multiple=64))


def llama3_debugmodel_block_causal_seq1f1b() -> SeqTrainer.Config:
    """The debug model with block-causal attention over short documents packed into each sequence.

    ``train_configs/debug_block_causal.toml``'s settings, on the shipped packed corpus.
    """
    return _debugmodel(
        "llama3",
        "debugmodel_flex_attn",
        PACKED_DATASET_NAME,
        SequencePipeline(num_subsequences=4, length_multiple=64, expected_document_length=_PACKED_DOCUMENT_LENGTH),
    )


def llama3_8b_32k_seq1f1b() -> SeqTrainer.Config:
    """Llama 3 8B at 32K tokens on 8 GPUs, pipeline 4 x FSDP 2, Seq1F1B with k = 4, compiled blocks.

    ``train_configs/llama3_8b_32k.toml``'s settings.
    """
    return _8b("8B")


def llama3_8b_32k_block_causal_seq1f1b() -> SeqTrainer.Config:
    """:func:`llama3_8b_32k_seq1f1b` with block-causal attention (packed documents).

    ``train_configs/llama3_8b_32k_block_causal.toml``'s settings.
    """
    return _8b("8B_flex")


def qwen3_debugmodel_moe_seq1f1b() -> SeqTrainer.Config:
    """Qwen3's MoE debug model (8 layers of 64 experts, 8 routed a token), Seq1F1B (k = 4) on 2 pipeline
    ranks (CPU by default), at 512 tokens a sequence (:func:`_small_debugmodel`)."""
    return _small_debugmodel("qwen3", "debugmodel_moe")


def qwen3_debugmodel_untied_seq1f1b() -> SeqTrainer.Config:
    """Qwen3's dense debug model with its output layer untied from its embeddings (0.3 pipelines no tied
    model), Seq1F1B (k = 4) on 2 pipeline ranks (CPU by default), at 512 tokens a sequence
    (:func:`_small_debugmodel`)."""
    return _small_debugmodel("qwen3", "debugmodel_untied")


def deepseek_v3_debugmodel_seq1f1b() -> SeqTrainer.Config:
    """DeepSeek-V3's debug model (multi-head latent attention, YaRN RoPE, a dense first layer, then 5 MoE
    layers of 8 experts, 3 routed a token, and 2 shared), Seq1F1B (k = 4) on 2 pipeline ranks (CPU by
    default), at 512 tokens a sequence (:func:`_small_debugmodel`)."""
    return _small_debugmodel("deepseek_v3", "debugmodel")


def gpt_oss_debugmodel_seq1f1b() -> SeqTrainer.Config:
    """gpt-oss's debug model (a sliding window of 128 on every other layer, a learned sink a head, 4 MoE
    layers of 8 experts, 4 routed a token), Seq1F1B (k = 4) on 2 pipeline ranks (CPU by default), at 512
    tokens a sequence (:func:`_small_debugmodel`): units of 128 tokens, so windows reach across units."""
    return _small_debugmodel("gpt_oss", "debugmodel")


def _config(family: str, flavor: str, **fields) -> SeqTrainer.Config:
    """The settings every shipped job shares, around the job's own.

    ``training.disable_cuda_graphs`` is on in each job's ``training``, as 0.3 asks of every
    pipeline-parallel job.

    Args:
        family: the model's family, a key of :data:`~torchtitan_seq.titan.v03.model.FLAVORS`.
        flavor: the model's flavor, a key of the family's.
        **fields: the job's other fields of :class:`SeqTrainer.Config`.

    Returns:
        The job's config: the flavor's ``<family>_seq`` model pipelined by
        :func:`~torchtitan_seq.titan.v03.pipeline.pipeline_sequence_llm`, with the whole output layer
        in each unit's loss, no activation checkpointing and seed 42.
    """
    model_spec = sequence_model_spec(family, flavor, pipeline_sequence_llm)
    return SeqTrainer.Config(
        model_spec=model_spec,
        # The whole output layer in each unit's loss (0.3's default chunks it inside the loss).
        loss=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size),
        activation_checkpoint=None,
        debug=DebugConfig(seed=42),
        **fields,
    )


def _debugmodel(
    family: str, flavor: str, dataset: str, sequence: SequencePipeline, seq_len: int = 2048, steps: int = 20
) -> SeqTrainer.Config:
    """A debug model's job: 2 pipeline ranks, the shipped tokenizer, a shipped ``dataset``, no checkpoints.

    Args:
        family: the debug model's family.
        flavor: its flavor (causal or block-causal).
        dataset: a shipped dataset's name.
        sequence: the job's ``sequence_pipeline`` section.
        seq_len: tokens a sequence.
        steps: training steps.

    Returns:
        The job's config.
    """
    return _config(
        family,
        flavor,
        hf_assets_path=str(TOKENIZER_DIR),  # the tokenizer shipped with torchtitan_seq
        dump_folder="./outputs",
        metrics=SeqMetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=4, seq_len=seq_len, max_norm=1.0, steps=steps, disable_cuda_graphs=True
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=dataset),  # shipped with torchtitan_seq
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=1, pipeline_parallel_degree=2, pipeline_parallel_schedule="Seq1F1B"
        ),
        sequence_pipeline=sequence,
        checkpoint=CheckpointManager.Config(enable=False, folder="checkpoint", interval=10),
        compile=CompileConfig(enable=False),
    )


def _small_debugmodel(family: str, flavor: str) -> SeqTrainer.Config:
    """The job of a debug model larger than Llama 3's: the Llama 3 debug job's settings at 512 tokens a
    sequence (a quarter of its), for 10 steps (torchtitan's own debug jobs' count of these families): Qwen3's
    MoE debug model, 300M parameters, takes some 25 s a step there on 2 CPU cores.

    Args:
        family: the model's family (``qwen3``, ``deepseek_v3``, ``gpt_oss``).
        flavor: its debug flavor, without tied weights.

    Returns:
        The job's config.
    """
    sequence = SequencePipeline(num_subsequences=4, length_multiple=64)
    return _debugmodel(family, flavor, DATASET_NAME, sequence, seq_len=512, steps=10)


def _8b(flavor: str) -> SeqTrainer.Config:
    """The 8B job: 32K-token sequences from C4 on pipeline 4 x FSDP 2, bf16, compiled, checkpointed.

    Args:
        flavor: the 8B model's flavor (causal or block-causal).

    Returns:
        The job's config.
    """
    return _config(
        "llama3",
        flavor,
        hf_assets_path="./assets/hf/Llama-3.1-8B",
        dump_folder="./outputs/llama3_8b_32k",
        metrics=SeqMetricsProcessor.Config(log_freq=10, enable_tensorboard=True),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200),
        training=TrainingConfig(
            local_batch_size=8,
            seq_len=32768,
            max_norm=1.0,
            steps=1000,
            mixed_precision_param="bfloat16",
            mixed_precision_reduce="float32",
            disable_cuda_graphs=True,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=2, pipeline_parallel_degree=4, pipeline_parallel_schedule="Seq1F1B"
        ),
        sequence_pipeline=SequencePipeline(num_subsequences=4, length_multiple=128),
        checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", interval=500),
        compile=CompileConfig(enable=True, components=["model", "loss"]),
    )
