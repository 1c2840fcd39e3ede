"""TeraPipe through torchtitan, with its own ('latency') sequence slicing.

Its exactness against the full-sequence reference is in test_seq1f1b.py.
"""

import pytest
from titan import assert_trained, run_train


@pytest.mark.slow
def test_terapipe_with_latency_partition_logs_the_losses_of_1f1b(tmp_path):
    """10 steps at seq 512, 4 microbatches, k = 4; a 16-token grid makes the latency cut uneven."""
    common = ("--training.seq_len", "512", "--training.local_batch_size", "4", "--training.steps", "10")
    tera = run_train(*common, "--parallelism.pipeline_parallel_schedule", "TeraPipe",
                     "--sequence_pipeline.partition", "latency", "--sequence_pipeline.length_multiple", "16",
                     dump_folder=tmp_path / "tera")
    ref = run_train(*common, "--parallelism.pipeline_parallel_schedule", "1F1B", dump_folder=tmp_path / "ref")
    assert_trained(tera, 10)
    assert_trained(ref, 10)
    assert "'latency' partition, lengths [144, 128, 128, 112]" in tera.output, tera.output[-3000:]
    assert max(abs(a - b) for a, b in zip(tera.losses, ref.losses)) <= 1e-3, (tera.losses, ref.losses)
