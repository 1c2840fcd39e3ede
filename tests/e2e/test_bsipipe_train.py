"""BSIPipe through torchtitan: from one seed checkpoint it logs the losses of 1F1B."""

import pytest

from titan import assert_same_losses, assert_trained, run_train

SMALL = ("--training.seq_len", "512", "--training.local_batch_size", "4")


@pytest.mark.slow
def test_logs_the_losses_of_1f1b_from_one_seed_checkpoint(tmp_path):
    """torchtitan seeds each pipeline rank differently, so both runs start from one seed checkpoint."""
    seed = run_train(
        *SMALL,
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree",
        "1",
        dump_folder=tmp_path / "seed",
        env={"NGPU": "1"},
    )
    assert seed.returncode == 0, seed.output[-3000:]
    runs = {}
    for schedule in ("BSIPipe", "1F1B"):
        folder = tmp_path / schedule
        runs[schedule] = run_train(
            *SMALL,
            "--training.steps",
            "5",
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            str(tmp_path / "seed" / "checkpoint" / "step-0"),
            "--checkpoint.load_only",
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            dump_folder=folder,
            check=False,
        )
        assert_trained(runs[schedule], 5)
    assert_same_losses(runs["BSIPipe"], runs["1F1B"])
    assert "BSIPipe placement 'paired':" in runs["BSIPipe"].output
