"""Packed documents through torchtitan: train_configs/debug_block_causal.toml (the shipped
packed corpus, the block-causal flavor debugmodel_flex_attn), 2 CPU ranks."""

import pytest
from titan import assert_same_losses, assert_trained, run_train

ENV = {"CONFIG_FILE": "train_configs/debug_block_causal.toml"}


@pytest.mark.slow
def test_block_causal_seq1f1b_logs_the_losses_of_1f1b(tmp_path):
    """Documents reach every stage and unit of Seq1F1B as torchtitan hands them to torch's 1F1B."""
    common = ("--training.seq_len", "1024", "--training.steps", "3")
    seq = run_train(*common, env=ENV, dump_folder=tmp_path / "seq", check=False)
    ref = run_train(*common, "--parallelism.pipeline_parallel_schedule", "1F1B", env=ENV,
                    dump_folder=tmp_path / "ref", check=False)
    assert_trained(seq, 3)
    assert_trained(ref, 3)
    assert_same_losses(seq, ref)
