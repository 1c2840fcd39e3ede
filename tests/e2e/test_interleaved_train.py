"""InterleavedSeq1F1B through torchtitan: ./run_train.sh logs the losses of torch's Interleaved1F1B."""

import pytest


@pytest.mark.slow
def test_torchtitan_run_logs_the_losses_of_interleaved_1f1b(shared_run, tmp_path):
    """./run_train.sh against torch's Interleaved1F1B: the same loop layout (2 stages per rank),
    so the same initial weights; 5 steps at seq 512, 4 microbatches of 4 subsequences. The 10-step
    Interleaved1F1B run is shared (test_train.py's smoke test of torch's schedules reads it)."""
    from titan import REFERENCE, assert_same_losses, assert_trained, run_train

    seq = run_train(
        *REFERENCE,
        "--training.steps",
        "5",
        "--parallelism.pipeline_parallel_schedule",
        "InterleavedSeq1F1B",
        dump_folder=tmp_path / "seq",
        check=False,
    )
    ref, _ = shared_run(*REFERENCE, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    assert_trained(seq, 5)
    assert_trained(ref, 10)
    assert "building stage_idx 2" in seq.output  # rank 0 holds stages 0 and 2
    assert_same_losses(seq, ref, steps=5)
