"""Training through torchtitan with ./run_train.sh (2 CPU ranks, gloo). Every schedule name trains a
step in the settings walk (test_settings_walk.py); these compare losses and memory over steps."""

import pytest

from titan import REFERENCE, assert_same_losses, assert_trained, max_diff, run_train

SMALL = ("--training.seq_len", "512", "--training.local_batch_size", "4")

# The shared runs and the bad-input tests go through ./run_train.sh as a user runs it; the other
# runs' jobs are valid (check=False: forked ranks, tests/helpers/forked_run.py), and every rank checks the
# job again.


@pytest.mark.slow
def test_seq1f1b_logs_the_losses_of_1f1b(shared_run):
    """10 steps at seq 512; both runs are shared (test_compose_titan.py, test_terapipe.py read them too)."""
    seq, _ = shared_run(*REFERENCE)
    ref, _ = shared_run(*REFERENCE, "--parallelism.pipeline_parallel_schedule", "1F1B")
    assert_trained(seq, 10)
    assert_trained(ref, 10)
    assert_same_losses(seq, ref)
    assert seq.losses[-1] < seq.losses[0] - 0.5  # it learns


@pytest.mark.slow
def test_interleaved_1f1b_trains(shared_run):
    """The shared 10-step run test_interleaved.py compares InterleavedSeq1F1B with."""
    run, _ = shared_run(*REFERENCE, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    assert_trained(run, 10)


@pytest.mark.slow
def test_seq1f1b_holds_fewer_activations_than_1f1b(tmp_path):
    """seq 1024, 4 microbatches, k=4, rank 0 (measured saved-activation peaks)."""
    common = ("--training.steps", "1", "--training.seq_len", "1024", "--training.local_batch_size", "4")
    one_f_one_b = run_train(
        *common, "--parallelism.pipeline_parallel_schedule", "1F1B", dump_folder=tmp_path / "a", check=False
    )
    compute = run_train(*common, dump_folder=tmp_path / "b", check=False)
    even = run_train(*common, "--sequence_pipeline.partition", "even", dump_folder=tmp_path / "c", check=False)
    for run in (one_f_one_b, compute, even):
        assert_trained(run, 1)
    base = one_f_one_b.activations_mib[0][0]
    assert compute.activations_mib[0][0] <= 0.8 * base, (compute.activations_mib, base)
    assert even.activations_mib[0][0] <= 0.7 * base, (even.activations_mib, base)


@pytest.mark.slow
def test_tensorboard_events_hold_the_metrics(shared_run):
    """The events of the shared 10-step Seq1F1B run (REFERENCE enables TensorBoard)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, dump = shared_run(*REFERENCE)
    assert_trained(run, 10)
    events = list(dump.glob("tb/**/events.out.tfevents.*"))
    assert events, run.output[-3000:]
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "loss_metrics/global_avg_loss",
        "throughput(tps)",
        "memory/peak_activation_bytes/rank0",
        "memory/peak_activation_bytes/rank1",
    } <= tags, tags


# run_train.sh's own check (a missing config) and its start-up run of the job check; the
# job check's other refusals are tested in process (tests/unit/test_job_check.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "args,env,needle",
    [
        ((), {"CONFIG_FILE": "missing.toml"}, "CONFIG_FILE=missing.toml does not exist"),
        ((), {"NGPU": "3"}, "do not fit 3 processes"),
    ],
)
def test_bad_input_fails_fast_with_one_message(args, env, needle, tmp_path):
    # Fast: one process checks the job and no rank starts (below); the timeout only ends a hang. The check
    # imports torchtitan, about 8 s alone, and took over 60 s in CI beside the torch 2.15 lanes.
    run = run_train(*args, dump_folder=tmp_path, env=env, timeout=300)
    assert run.returncode == 2, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], run.output[-3000:]


@pytest.mark.slow
def test_block_causal_training_and_validation_log_the_losses_of_1f1b(tmp_path):
    """Packed documents (train_configs/debug_block_causal.toml: the shipped packed corpus, the
    block-causal flavor debugmodel_flex_attn) reach every stage and unit of Seq1F1B as
    torchtitan hands them to torch's 1F1B, in training and in validation, which runs the
    training pipeline (same cut); every rank reports the last stage's loss."""
    validation = (
        "--training.steps",
        "2",
        "--training.seq_len",
        "512",
        "--validation.enable",
        "--validation.seq_len",
        "512",
        "--validation.local_batch_size",
        "4",
        "--validation.steps",
        "1",
        "--validation.freq",
        "1",
        "--validation.dataset",
        "seqpp_packed_validation",
    )
    runs = {
        schedule: run_train(
            *validation,
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            env={"CONFIG_FILE": "train_configs/debug_block_causal.toml"},
            dump_folder=tmp_path / schedule,
            check=False,
        )
        for schedule in ("Seq1F1B", "1F1B")
    }
    for run in runs.values():
        assert_trained(run, 2)
        assert len(run.validation_losses) == 2 and min(run.validation_losses) > 1, run.validation_losses
    assert_same_losses(runs["Seq1F1B"], runs["1F1B"])
    seq, ref = runs["Seq1F1B"].validation_losses, runs["1F1B"].validation_losses
    assert max_diff(seq, ref) <= 1e-3, (seq, ref)
