"""torchtitan 0.3 end to end: from one seed checkpoint, Seq1F1B and BSIPipe log torch's 1F1B losses."""

from __future__ import annotations

import shutil

import pytest
from titan03_run import run_train

from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="runs ./run_train.sh with torchtitan 0.3")

SMALL = ("--training.seq-len", "256", "--training.local-batch-size", "4", "--sequence-pipeline.length-multiple", "16")
STEPS = 3


@pytest.mark.slow
def test_seq1f1b_and_bsipipe_log_the_losses_of_1f1b_from_one_seed_checkpoint(tmp_path):
    """torchtitan seeds each pipeline rank differently, so every run starts from one seed checkpoint."""
    seed = run_train(
        *SMALL,
        "--checkpoint.enable",
        "--checkpoint.create-seed-checkpoint",
        "--parallelism.pipeline-parallel-degree",
        "1",
        dump_folder=tmp_path / "seed",
        env={"NGPU": "1"},
    )
    assert seed.returncode == 0, seed.output[-3000:]
    losses = {}
    for schedule in ("1F1B", "Seq1F1B", "BSIPipe"):
        folder = tmp_path / schedule
        shutil.copytree(tmp_path / "seed" / "checkpoint", folder / "checkpoint")
        run = run_train(
            *SMALL,
            "--training.steps",
            str(STEPS),
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1000",
            "--parallelism.pipeline-parallel-schedule",
            schedule,
            dump_folder=folder,
            env={"TORCHTITAN_SEQ_SKIP_CHECK": "1"} if schedule != "BSIPipe" else None,
        )
        assert run.returncode == 0, run.output[-4000:]
        losses[schedule] = run.losses
        assert len(losses[schedule]) == STEPS, run.output[-4000:]
    for schedule in ("Seq1F1B", "BSIPipe"):
        assert max(abs(a - b) for a, b in zip(losses[schedule], losses["1F1B"])) < 1e-3, losses
