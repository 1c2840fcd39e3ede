"""TeraPipe through torchtitan, with its own ('latency') sequence slicing.

Its exactness against the full-sequence reference is in test_seq1f1b.py.
"""

import pytest

from titan import REFERENCE, assert_same_losses, assert_trained, run_train


@pytest.mark.slow
def test_terapipe_with_latency_partition_logs_the_losses_of_1f1b(shared_run, tmp_path):
    """5 steps at seq 512, 4 microbatches, k = 4; a 16-token grid makes the latency cut uneven.

    The 1F1B run is the shared 10-step one (test_train.py compares Seq1F1B with it too).
    """
    tera = run_train(
        *REFERENCE,
        "--training.steps",
        "5",
        "--parallelism.pipeline_parallel_schedule",
        "TeraPipe",
        "--sequence_pipeline.partition",
        "latency",
        "--sequence_pipeline.length_multiple",
        "16",
        dump_folder=tmp_path / "tera",
        check=False,
    )
    ref, _ = shared_run(*REFERENCE, "--parallelism.pipeline_parallel_schedule", "1F1B")
    assert_trained(tera, 5)
    assert_trained(ref, 10)
    assert "'latency' partition, lengths [144, 128, 128, 112]" in tera.output, tera.output[-3000:]
    assert_same_losses(tera, ref, steps=5)
